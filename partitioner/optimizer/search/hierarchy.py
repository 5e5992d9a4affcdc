"""Hierarchical clusters (servers made of GPUs): PipeDream's recursion over the levels, exact per level.

Inner levels need the best time of *every* segment on one unit, as PipeDream's recursion does;
``_all_segments`` fills that table one unit count at a time, every segment at once, and the outermost
level is solved by the flat solver (``dp.solve_bottleneck``) with segment times read from the tables.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from partitioner.optimizer.pricing.stage import FloatArray, IntArray, stage_time
from partitioner.optimizer.search.dp import LevelProblem, Segment, cut_states, solve_bottleneck
from partitioner.optimizer.search.reach import compute_floors
from partitioner.optimizer.search.states import StateSet, csr_offsets, prefix_chain, runs, thin_prefixes
from partitioner.plan import Link

__all__ = ["solve_hierarchy"]


@dataclass(frozen=True)
class _Tables:
    """Best time of every segment (i, j] of one level on up to m units: ``opened[m]`` (m < units) pays
    for its output, ``closed`` (all units) leaves it to the next level; inf above the ceiling."""

    prob: LevelProblem
    opened: FloatArray  # [m, i, j]; m = 0 unused
    closed: FloatArray  # [i, j]


def _all_segments(
    prob: LevelProblem, ceiling: float = math.inf, top: LevelProblem | None = None, search: str = "auto",
    rows: npt.NDArray[np.bool_] | None = None,
) -> _Tables:  # fmt: skip
    """Direct DP over all segments at once (PipeDream's non-final level), one unit count at a time,
    skipping what the level above cannot use below ``ceiling`` (docs/optimizer-search.md); ``search``:
    how splits are listed (``_Splits``; tests pin "window" or "column", both exact)."""
    n, units = len(prob.states), prob.units
    cap = prob.cap
    opened = np.full((units, n, n), np.inf)
    closed = np.full((n, n), np.inf)
    before, after = _top_windows(prob, ceiling, top)
    pairs = _LevelPairs.of(prob, ceiling, top, before, after)
    splits = _Splits.of(prob, pairs, search)
    prior: dict[int, _Prior] = {}  # opened[u] with its search structures, once complete
    filled = np.arange(n, dtype=np.int64) if rows is None else np.flatnonzero(rows)
    for m in range(1, units + 1):
        out = m < units
        limit = pairs.limit[out]
        best = np.full(n * n, np.inf)
        best[splits.flat] = pairs.grid[out, False][: min(m, cap)].min(axis=0)
        keep = pairs.span <= m * limit * prob.unit_devices
        if rows is not None:  # a top stage starts at a row; on all the units, it also ends at one
            keep &= rows[pairs.ks] & (rows[splits.js] | out)
        cells = splits.flat[keep]
        reps = range(1, min(m - 1, cap) + 1)
        lasts = {r: splits.dense(pairs.grid[out, True][r - 1]) for r in reps}
        if m > 1:  # a bound from the balanced splits with a one-replica last stage (wider ones rarely win)
            splits.probe(best, prior[m - 1].table, lasts[1], (m - 1, 1), cells)
        for r in reps:
            bound = np.full(n * n, -np.inf)  # what a split must meet; -inf: the entry takes none
            bound[cells] = np.minimum(best[cells], limit[keep])
            splits.fold(best, bound, prior[m - r], lasts[r], (m - r, r), cells)
        best = best[splits.flat]
        best[best > limit] = np.inf
        table = opened[m] if out else closed
        table[pairs.ks, splits.js] = best
        prior[m] = _Prior(table, splits.order, filled)
    return _Tables(prob, opened, closed)


@dataclass(frozen=True)
class _LevelPairs:
    """Every (k, j) pair of a level (CSR by j) with its stage times and ceilings, computed at once.

    ``grid[charge_out, charge_in]`` is [replicas, pair] (``_segment_grids``);
    ``limit[charge_out]`` is ``_limits`` of the pair's start (after = 0 for open segments).
    """

    offsets: IntArray
    ks: IntArray
    span: FloatArray
    grid: dict[tuple[bool, bool], FloatArray]
    limit: dict[bool, FloatArray]

    @staticmethod
    def of(
        prob: LevelProblem, ceiling: float, top: LevelProblem | None, before: IntArray, after: IntArray
    ) -> _LevelPairs:
        s, n = prob.states, len(prob.states)
        ks, js = s.all_pairs()
        offsets = csr_offsets(js, n)
        params = s.param_bytes[js] - s.param_bytes[ks]
        grid = _segment_grids(prob, js, ks, np.arange(1, prob.cap + 1, dtype=np.float64)[:, None])
        limit = {True: _limits(ceiling, top, before[ks], 0, params),
                 False: _limits(ceiling, top, before[ks], after[js], params)}  # fmt: skip
        return _LevelPairs(offsets, ks, s.compute_s[js] - s.compute_s[ks], grid, limit)


CHUNK = 1 << 16  # splits priced per numpy pass: big enough to amortise calls, small enough for cache
COLUMN_RATIO = 16  # splits per entry past which listing by column may pay: CNNs stay under 8, GNMT over 90


@dataclass(frozen=True)
class _Splits:
    """Finds the splits (i, k, j) of one level that can meet a bound, by compute window (tight where
    compute dominates: CNNs) or by column (where communication does: GNMT), whichever lists fewer per
    end j (docs/optimizer-search.md). Tables are flat: entry (i, j) at i·n + j."""

    n: int
    ks: IntArray  # per pair (k, j) of the level
    js: IntArray
    flat: IntArray  # per pair: k·n + j
    compute: FloatArray
    order: IntArray  # states by compute
    devices: int  # devices per unit
    search: str  # "window", "column", or "auto": per end j, whichever lists fewer splits

    @staticmethod
    def of(prob: LevelProblem, pairs: _LevelPairs, search: str = "auto") -> _Splits:
        n = len(prob.states)
        js = np.repeat(np.arange(n), np.diff(pairs.offsets))
        c = prob.states.compute_s
        return _Splits(n, pairs.ks, js, pairs.ks * n + js, c, np.argsort(c, kind="stable"),
                       prob.unit_devices, search)  # fmt: skip

    def dense(self, per_pair: FloatArray) -> FloatArray:
        """A per-pair value as a flat table (inf off the pairs)."""
        table = np.full(self.n * self.n, np.inf)
        table[self.flat] = per_pair
        return table

    def probe(self, best: FloatArray, first: FloatArray, last: FloatArray, units: tuple[int, int],
              cells: IntArray) -> None:  # fmt: skip
        """best[i, j] lowered by the splits k whose compute is nearest the balanced one.

        The balanced split gives the first part units[0] / (units[0] + units[1]) of the compute;
        the two states either side of it in compute order are tried (any split is a valid plan).
        """
        n, c = self.n, self.compute
        i, j = cells // n, cells % n
        mid = c[i] + (c[j] - c[i]) * (units[0] / (units[0] + units[1]))
        at = np.searchsorted(c[self.order], mid)
        value = best[cells]  # cells are distinct: no ufunc.at needed
        for shift in (-1, 0):
            k = self.order[np.clip(at + shift, 0, n - 1)]
            value = np.minimum(value, np.maximum(first.reshape(-1)[i * n + k], last[k * n + j]))
        best[cells] = value

    def fold(self, best: FloatArray, bound: FloatArray, first: _Prior, last: FloatArray,
             units: tuple[int, int], cells: IntArray) -> None:  # fmt: skip
        """best[i, j] = min(best, max(first[i, k], last[k, j])) over the splits meeting ``bound``.

        ``first``: the table on units[0] units; ``last``: the stage on units[1] replicas;
        ``bound``: -inf where an entry takes no split; ``cells``: the entries that may.
        """
        n = self.n
        i, j = cells // n, cells % n
        b = bound[cells]
        slack = 1e-9 * (abs(float(self.compute[-1])) + 1e-30)  # the compute bounds are not rounded
        sorted_c = self.compute[self.order]
        lo = np.searchsorted(sorted_c, self.compute[j] - units[1] * self.devices * b - slack, side="left")
        by_window = np.full(n, self.search != "column")
        if self.search != "window" and self._crowded(i, b, lo, units[0], slack):  # wide windows (GNMT)
            pick, start, tall = self._columns(bound, first.index, last)
            if self.search == "auto":  # per end j, whichever lists fewer (the window capped by compute)
                hi = self._compute_cap(i, b, units[0], slack)
                by_window = np.bincount(j, np.maximum(hi - lo, 0), n) <= np.bincount(self.js[pick], tall, n)
            take = ~by_window[self.js[pick]]
            self._fold_columns(best, bound, first.index, last, pick[take], start[take], tall[take])
        w = by_window[j]
        flat_first, i, j, b, lo = first.table.reshape(-1), i[w], j[w], b[w], lo[w]
        wide = np.maximum(first.count(i, b) - lo, 0)
        for owner, at in _runs(lo, wide):
            k, ii, jj = self.order[at], i[owner], j[owner]
            _lower(best, bound, ii * n + jj, np.maximum(flat_first[ii * n + k], last[k * n + jj]))

    def _crowded(self, i: IntArray, b: FloatArray, lo: IntArray, units: int, slack: float) -> bool:
        """Whether listing by column may pay: windows average over ``COLUMN_RATIO`` splits per entry
        (measured on every 16th entry: a wrong guess costs time, never the optimum)."""
        if self.search == "column":
            return True
        hi = self._compute_cap(i[::16], b[::16], units, slack)
        return bool(np.maximum(hi - lo[::16], 0).sum() > COLUMN_RATIO * len(hi))

    def _compute_cap(self, i: IntArray, b: FloatArray, units: int, slack: float) -> IntArray:
        """End of the compute-ordered window: k's compute fits ``units`` units after i at b."""
        c = self.compute[self.order]
        return np.asarray(
            np.searchsorted(c, self.compute[i] + units * self.devices * b + slack, side="right")
        )

    def _columns(self, bound: FloatArray, index: _SortedTable, last: FloatArray
                 ) -> tuple[IntArray, IntArray, IntArray]:  # fmt: skip
        """Pairs (k, j) whose stage meets end j's largest bound, with their column runs."""
        top = bound.reshape(self.n, self.n).max(axis=0)
        pick = np.flatnonzero(last[self.flat] <= top[self.js])
        start, stop = index.upto(self.ks[pick], index.ranks(top)[self.js[pick]])
        return pick, start, np.maximum(stop - start, 0)

    def _fold_columns(self, best: FloatArray, bound: FloatArray, index: _SortedTable, last: FloatArray,
                      pick: IntArray, start: IntArray, count: IntArray) -> None:  # fmt: skip
        for owner, at in _runs(start, count):
            pair = pick[owner]
            _lower(best, bound, index.rows[at] * self.n + self.js[pair],
                   np.maximum(index.values[at], last[self.flat[pair]]))  # fmt: skip


@dataclass(frozen=True)
class _Prior:
    """A finished table on fewer units, with the search structures ``_Splits.fold`` may need."""

    table: FloatArray
    order: IntArray
    rows: IntArray  # the rows filled (the others are inf)

    @functools.cached_property
    def index(self) -> _SortedTable:
        return _SortedTable.of(self.table)

    def count(self, i: IntArray, b: FloatArray) -> IntArray:
        """Per entry (row i, bound b): how many compute-order positions have an entry <= b at or
        after them (``_Monotone.count``; a few more at most)."""
        return self.reach.count(self.row_of[i], b)

    @functools.cached_property
    def row_of(self) -> IntArray:
        where = np.zeros(len(self.table), dtype=np.int64)
        where[self.rows] = np.arange(len(self.rows))
        return where

    @functools.cached_property
    def reach(self) -> _Monotone:
        """Per filled row and compute-order position p: the best entry at p or later (never decreasing)."""
        later = np.minimum.accumulate(self.table[self.rows][:, self.order][:, ::-1], axis=1)[:, ::-1]
        return _Monotone.of(np.ascontiguousarray(later))


@dataclass(frozen=True)
class _Monotone:
    """Rows that never decrease, flattened with a row offset so one searchsorted counts, per row, the
    entries at most b (or a few more: the offset costs float precision; docs/optimizer-search.md)."""

    keys: FloatArray
    scale: float
    width: int

    @staticmethod
    def of(rows: FloatArray) -> _Monotone:
        finite = np.isfinite(rows)
        scale = max(float(rows[finite].max(initial=0.0)), 1e-30)
        offset = 4.0 * scale * np.arange(rows.shape[0], dtype=np.float64)[:, None]
        keys = offset + np.where(finite, rows, 3.0 * scale)
        return _Monotone(keys.reshape(-1), scale, rows.shape[1])

    def count(self, rows: IntArray, b: FloatArray) -> IntArray:
        s = self.scale
        q = 4.0 * s * rows + (np.clip(b, -0.5 * s, 2.0 * s) + 1e-6 * s)
        return np.searchsorted(self.keys, q, side="right") - self.width * rows


def _lower(best: FloatArray, bound: FloatArray, cell: IntArray, value: FloatArray) -> None:
    good = value <= bound[cell]
    np.minimum.at(best, cell[good], value[good])


def _runs(start: IntArray, count: IntArray) -> Iterator[tuple[IntArray, IntArray]]:
    """The runs [start, start + count) in blocks of about CHUNK: (run of each element, element)."""
    ends = np.cumsum(count)
    if not len(ends) or ends[-1] == 0:
        return
    cuts = np.unique(np.searchsorted(ends, np.arange(CHUNK, int(ends[-1]), CHUNK), side="right"))
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(count)], strict=True):
        if a < b:
            owner, at = runs(start[a:b], count[a:b])
            yield owner + a, at


@dataclass(frozen=True)
class _SortedTable:
    """The finite entries (i, k) of one table, sorted by k then by value: one searchsorted counts, for
    any k and threshold, the entries of column k at most the threshold."""

    rows: IntArray
    values: FloatArray
    key: IntArray
    sorted_values: FloatArray
    starts: IntArray  # column k's entries begin at starts[k]

    @staticmethod
    def of(table: FloatArray) -> _SortedTable:
        i, k = np.nonzero(np.isfinite(table))
        v = table[i, k]
        sorted_values = np.sort(v)
        key = k * (len(v) + 1) + np.searchsorted(sorted_values, v, side="right")
        order = np.argsort(key, kind="stable")
        starts = csr_offsets(k, table.shape[1])
        return _SortedTable(i[order], v[order], key[order], sorted_values, starts)

    def upto(self, k: IntArray, rank: IntArray) -> tuple[IntArray, IntArray]:
        """[start, stop) of the entries (., k) whose value has at most ``rank`` (``ranks``)."""
        stop = np.searchsorted(self.key, k * (len(self.values) + 1) + rank, side="right")
        return self.starts[k], stop

    def ranks(self, threshold: FloatArray) -> IntArray:
        """How many entries are at most each threshold: the rank ``upto`` compares with."""
        return np.asarray(np.searchsorted(self.sorted_values, threshold, side="right"), dtype=np.int64)


def _top_windows(prob: LevelProblem, ceiling: float, top: LevelProblem | None) -> tuple[IntArray, IntArray]:
    """Top-level units any plan as fast as ``ceiling`` surely has before / after each state."""
    n = len(prob.states)
    if top is None or not (math.isfinite(ceiling) and ceiling > 0):
        return np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    return compute_floors(prob.states.compute_s, top.unit_devices, ceiling)


def _limits(
    ceiling: float, top: LevelProblem | None, before: IntArray, after: int | IntArray, params: FloatArray
) -> FloatArray:
    """Slowest entry worth keeping per segment start i (the segment (i, j] has ``params``): what a top
    stage on at most ``room`` replicas, paying its gradient sync, can still use."""
    if top is None or not (math.isfinite(ceiling) and ceiling > 0):
        return np.full(len(before), ceiling * (1 + 1e-9))
    room = np.minimum(top.cap, top.units - before - after)
    best = np.full(len(params), -1.0)
    volume = 4.0 * params / (top.link.sync_bandwidth * top.inner)
    for r in range(1, max(int(room.max(initial=0)), 1) + 1):
        value = r * ceiling * (1 + 1e-9) - (r - 1.0) * (volume / r + 2.0 * top.link.sync_latency)
        np.maximum(best, value, out=best, where=room >= r)
    return best


def _segment_grids(
    prob: LevelProblem, j: int | IntArray, ks: IntArray, reps: FloatArray
) -> dict[tuple[bool, bool], FloatArray]:
    """[r, k]: time of stages (ks, j] on reps[r, 0] units, by the cuts they pay for: keyed
    (charge_out, charge_in), the cut after the stage and the one before it."""
    s, n = prob.states, len(prob.states)
    dp = s.param_bytes[j] - s.param_bytes[ks]
    act_in = np.where(ks > 0, s.act_bytes[ks], 0.0)
    act_out = np.where(j < n - 1, s.act_bytes[j], 0.0)
    keys = [(out, into) for out in (False, True) for into in (False, True)]
    acts = np.stack(np.broadcast_arrays(*(np.maximum(act_in * into, act_out * out) for out, into in keys)))
    times = stage_time(prob.base_time(j, ks), dp, reps, prob.link, prob.inner, acts[:, None])
    return {key: times[i] for i, key in enumerate(keys)}


def _unfold(tables: _Tables, m: int, i: int, j: int, is_open: bool) -> list[Segment]:
    """The inner stages of the best plan of segment (i, j] on up to m units (recomputed)."""
    prob, s = tables.prob, tables.prob.states
    target = tables.opened[m, i, j] if is_open else tables.closed[i, j]
    ks = s.pred(j)
    ks = ks[np.array([s.masks[i] & ~s.masks[k] == 0 and k != i for k in ks], dtype=bool)]
    reps = np.arange(1, min(m, prob.cap) + 1, dtype=np.float64)[:, None]
    alone = _segment_grids(prob, j, np.array([i], dtype=np.int64), reps)[is_open, False][:, 0]
    lasts = _segment_grids(prob, j, ks, reps)[is_open, True]
    for r in range(1, len(reps) + 1):
        if alone[r - 1] == target:
            return [Segment(i, j, r)]
        if m - r >= 1 and len(ks):
            hit = np.flatnonzero(np.maximum(tables.opened[m - r, i, ks], lasts[r - 1]) == target)
            if len(hit):
                k = int(ks[hit[0]])
                return [*_unfold(tables, m - r, i, k, True), Segment(k, j, r)]
    raise RuntimeError("segment table and its unfolding disagree (a pipeplan bug)")


def solve_hierarchy(
    states: StateSet, levels: list[tuple[int, Link]], max_replicas: int | None = None
) -> tuple[float, list[Segment], float]:
    """PipeDream's recursion: each inner level's best segment time is the next level's compute time.

    Quick hierarchies over thinned prefixes give attained times first, each bounding the next
    (``_subsets``); the inner tables then skip what no plan that fast could use (``_all_segments``'
    ceiling, and the rows of ``_top_cuts``).
    """
    upper = math.inf
    for subset in _subsets(states):
        upper = min(upper, _solve_levels(subset, levels, max_replicas, upper)[0])
    return _solve_levels(states, levels, max_replicas, upper)


def _subsets(states: StateSet, most: int = 48) -> list[StateSet]:
    """Prefixes thinned evenly by compute, smallest first: of the layer order, then of every order
    prefix states come from (plans mixing them: NASNet-large 4x4's bound 52.2 ms instead of 60.7)."""
    chain = prefix_chain(states, most) if len(states) > most else None
    out = [] if chain is None else [chain[1]]
    thin = thin_prefixes(states, most)
    return out if thin is None else [*out, thin]


def _solve_levels(
    states: StateSet, levels: list[tuple[int, Link]], max_replicas: int | None, upper: float
) -> tuple[float, list[Segment], float]:
    tables: list[_Tables] = []
    base: Callable[[int | IntArray, IntArray], FloatArray] | None = None
    inner, below = 1, 1
    caps = [d if max_replicas is None else min(d, max_replicas) for d, _ in levels]
    for level, (devices, bw) in enumerate(levels[:-1]):
        prob = LevelProblem(states, devices, bw, inner, base, max_replicas=max_replicas, unit_devices=below)
        last = level == len(levels) - 2
        above = _top_floor(states, levels[-1], max_replicas, devices, below * devices) if last else None
        rows = _top_cuts(above, upper)
        table = _all_segments(prob, upper * math.prod(caps[level + 1 :]) if above is None else upper, above,
                              rows=rows)  # fmt: skip
        tables.append(table)
        base = _base_from(table)
        inner, below = devices, below * devices
    devices, bw = levels[-1]
    lower = float(states.compute_s[-1]) / math.prod(d for d, _ in levels)
    top = LevelProblem(states, devices, bw, inner, base, max_replicas=max_replicas, unit_devices=below)
    time, stages, lo = solve_bottleneck(top, lower)

    def expand(seg: Segment, level: int) -> Segment:
        if level < 0:
            return seg
        subs = _unfold(tables[level], levels[level][0], seg.start, seg.end, False)
        return Segment(seg.start, seg.end, seg.replicas, tuple(expand(x, level - 1) for x in subs))

    return time, [expand(seg, len(tables) - 1) for seg in stages], lo


def _top_floor(
    states: StateSet, top: tuple[int, Link], max_replicas: int | None, inner: int, unit_devices: int
) -> LevelProblem:
    """The last level as the level below it sees it (for the ceilings of its tables): a top
    segment's time, the table still being filled, is at least its compute over a top unit's
    ``unit_devices``; ``inner``: the devices of the level below in one top unit."""
    c = states.compute_s

    def base(j: int | IntArray, ks: IntArray) -> FloatArray:
        return np.asarray((c[j] - c[ks]) / unit_devices, dtype=np.float64)

    return LevelProblem(states, *top, inner, base, max_replicas=max_replicas, unit_devices=unit_devices)


def _top_cuts(top: LevelProblem | None, upper: float) -> npt.NDArray[np.bool_] | None:
    """States a top-level plan as fast as ``upper`` can cut at (None: any, when upper is unknown); only
    those rows of the table below are filled (ResNet-101 on 4x4: 18 of 411 at the first bound)."""
    if top is None or not (math.isfinite(upper) and upper > 0):
        return None
    return cut_states(top, upper)


def _base_from(table: _Tables) -> Callable[[int | IntArray, IntArray], FloatArray]:
    best = table.closed

    def base(j: int | IntArray, ks: IntArray) -> FloatArray:
        return np.asarray(best[ks, j], dtype=np.float64)

    return base
