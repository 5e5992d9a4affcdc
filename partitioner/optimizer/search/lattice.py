"""Exact search over *all* downsets without enumerating stage pairs (billions on Inception-v3), by
bisection on the time with a max-propagation through the downset lattice (docs/optimizer-search.md)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from partitioner.errors import InfeasibleError
from partitioner.graph import Profile
from partitioner.optimizer.pricing.stage import FloatArray, IntArray, stage_time
from partitioner.optimizer.search.dp import Segment
from partitioner.optimizer.search.states import (
    WordArray,
    _columns,
    _layers,
    _pack,
    _unpack,
    csr_offsets,
    more_downsets_than,
    runs,
)
from partitioner.plan import Link

__all__ = ["Lattice", "enumerate_lattice", "solve_lattice"]

SLACK = 1e-6  # float32 probes: thresholds are trusted to this relative precision


@dataclass(frozen=True)
class Lattice:
    """All downsets, grouped by size, with their lower covers (the downset minus one maximal layer).

    Attributes:
        layer_ids: the layers, topologically ordered (bit i of a mask = layer_ids[i]).
        masks: every downset as a row of 64-bit words (bit i = layer i), ordered by size; row 0 is
            empty, the last row is everything.
        starts: states of size s are ``starts[s]:starts[s + 1]``.
        cover_ptr, cover_idx: the lower covers of state j (global indices, in discovery order) are
            ``cover_idx[cover_ptr[j]:cover_ptr[j + 1]]``.
        compute_s, param_bytes, act_bytes: additive sums and the bytes leaving each downset.
        stage_s: seconds every stage adds whatever its layers (``StateSet.stage_s``).
    """

    layer_ids: tuple[str, ...]
    masks: WordArray
    starts: IntArray
    cover_ptr: IntArray
    cover_idx: IntArray
    compute_s: FloatArray
    param_bytes: FloatArray
    act_bytes: FloatArray
    stage_s: float = 0.0

    def members(self, k: int, j: int) -> tuple[str, ...]:
        """Layer ids in downset j but not in downset k, in topological order."""
        diff = _unpack(self.masks[j : j + 1] & ~self.masks[k : k + 1], len(self.layer_ids))[0]
        return tuple(self.layer_ids[i] for i in np.flatnonzero(diff))

    def index_of(self, mask: int) -> int:
        """The state whose downset is ``mask`` (bit i = layer i); ValueError if it is not one."""
        size = mask.bit_count()
        lo, hi = int(self.starts[size]), int(self.starts[size + 1]) if size + 1 < len(self.starts) else 0
        row = _pack([mask], len(self.layer_ids))
        hit = np.flatnonzero((self.masks[lo:hi] == row).all(axis=1))
        if not len(hit):
            raise ValueError("not a downset of this lattice")
        return lo + int(hit[0])


@dataclass(frozen=True)
class _Dag:
    """The layer DAG as packed bit rows and CSR neighbour lists, for vectorised growth."""

    bit: WordArray  # [layer, word]: the layer's own bit
    pred: WordArray  # [layer, word]: its predecessors
    succ: WordArray
    pred_csr: tuple[IntArray, IntArray]
    succ_csr: tuple[IntArray, IntArray]
    comp: FloatArray
    par: FloatArray
    out: FloatArray
    sends: FloatArray  # out[x] where x has readers, else 0

    @staticmethod
    def of(profile: Profile) -> _Dag:
        ids, preds, succs = _layers(profile)
        width = len(ids)
        pred, succ = _pack(preds, width), _pack(succs, width)
        comp, par, _, out = _columns(profile, ids)[:, :4].T.copy()
        return _Dag(
            _pack([1 << x for x in range(width)], width), pred, succ, _csr(pred), _csr(succ), comp, par, out,
            np.where(np.array([s != 0 for s in succs], dtype=bool), out, 0.0),
        )  # fmt: skip


def _csr(rows: WordArray) -> tuple[IntArray, IntArray]:
    """The set bits of each row as CSR lists (ascending)."""
    row, bit = _set_bits(rows)
    return csr_offsets(row, len(rows)), bit


def _expand(csr: tuple[IntArray, IntArray], x: IntArray) -> tuple[IntArray, IntArray]:
    """(i, y) for every neighbour y of x[i] in the CSR lists."""
    ptr, flat = csr
    row, at = runs(ptr[x], ptr[x + 1] - ptr[x])
    return row, flat[at]


def _inside(words: WordArray, rows: WordArray) -> npt.NDArray[np.bool_]:
    """Row-wise subset test: words[i] is contained in rows[i]."""
    return np.asarray(((words & ~rows) == 0).all(axis=1))


def _act_delta(dag: _Dag, x: IntArray, grown: WordArray) -> FloatArray:
    """Change of the bytes leaving each downset when maximal layer x joins it.

    Byte counts are whole numbers, so the sum is exact in any order.
    """
    row, y = _expand(dag.pred_csr, x)
    done = _inside(dag.succ[y], grown[row])  # y's last reader arrived: its output no longer leaves
    freed = np.bincount(row[done], weights=dag.out[y[done]], minlength=len(x))
    return np.asarray(dag.sends[x] - freed, dtype=np.float64)


def _next_free(dag: _Dag, free: WordArray, x: IntArray, grown: WordArray) -> WordArray:
    """Layers that may join each grown downset: the parent's, less x, plus x's ready successors."""
    out = free & ~dag.bit[x]
    row, y = _expand(dag.succ_csr, x)
    ready = _inside(dag.pred[y], grown[row])
    np.bitwise_or.at(out, row[ready], dag.bit[y[ready]])
    return out


def enumerate_lattice(profile: Profile, cap: int, max_layer: int = 10_000) -> Lattice | None:
    """Every downset, size layer by size layer, with covers and sums (vectorised per size layer); None
    beyond ``cap`` downsets or ``max_layer`` in one size layer (a cheap sign the total explodes)."""
    if more_downsets_than(profile, cap):
        return None
    dag = _Dag.of(profile)
    words = dag.bit.shape[1]
    salt = _mix(np.arange(1, len(dag.comp) + 1, dtype=np.uint64))
    rows, keys = np.zeros((1, words), dtype=np.uint64), np.zeros(1, dtype=np.uint64)
    free = np.bitwise_or.reduce(dag.bit[(dag.pred == 0).all(axis=1)], axis=0, keepdims=True)
    sums = (np.zeros(1), np.zeros(1), np.zeros(1))
    parts: list[tuple[WordArray, FloatArray, FloatArray, FloatArray, IntArray, IntArray]] = []
    starts, total = [0, 1], 1
    while True:
        parent, x = _set_bits(free)
        if not len(x):
            break
        grown = rows[parent] | dag.bit[x]
        first, new_of = _distinct(grown, keys[parent] + salt[x])
        if len(first) > max_layer or total + len(first) > cap:
            return None
        p0, x0, rows, keys = parent[first], x[first], grown[first], keys[parent[first]] + salt[x[first]]
        act = _act_delta(dag, x0, rows)
        sums = (sums[0][p0] + dag.comp[x0], sums[1][p0] + dag.par[x0], sums[2][p0] + act)
        free = _next_free(dag, free[p0], x0, rows)
        covers = parent[np.argsort(new_of, kind="stable")] + starts[-2]
        parts.append((rows, *sums, np.bincount(new_of, minlength=len(first)), covers))
        total += len(first)
        starts.append(total)
    return _assemble(profile, parts, words, np.array(starts, dtype=np.int64))


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finaliser: well-spread 64-bit words from small integers (hash salts)."""
    x = x * np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return np.asarray(x ^ (x >> np.uint64(31)), dtype=np.uint64)


def _set_bits(rows: WordArray) -> tuple[IntArray, IntArray]:
    """(row, bit) of every set bit, row-major and ascending: non-zero bytes first (bits are sparse)."""
    as_bytes = np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), -1)
    row, byte = np.nonzero(as_bytes)
    bits = np.unpackbits(as_bytes[row, byte][:, None], axis=1, bitorder="little")
    at, bit = np.nonzero(bits)
    return row[at].astype(np.int64), (byte[at] * 8 + bit).astype(np.int64)


def _distinct(grown: WordArray, keys: npt.NDArray[np.uint64]) -> tuple[IntArray, IntArray]:
    """Distinct rows by first occurrence, and each row's index among them (in that order), by additive
    hashes ``keys`` (a collision falls back to sorting the rows)."""
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    inverse = inverse.ravel()
    if not (grown == grown[first[inverse]]).all():  # a hash collision (never seen): exact fallback
        view = np.ascontiguousarray(grown).view(np.dtype((np.void, 8 * grown.shape[1]))).ravel()
        _, first, inverse = np.unique(view, return_index=True, return_inverse=True)
        inverse = inverse.ravel()
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return first[order].astype(np.int64), rank[inverse].astype(np.int64)


def _assemble(
    profile: Profile,
    parts: list[tuple[WordArray, FloatArray, FloatArray, FloatArray, IntArray, IntArray]],
    words: int,
    starts: IntArray,
) -> Lattice:
    ids = tuple(_layers(profile)[0])
    zero = np.zeros(1)
    counts = np.concatenate([np.zeros(1, dtype=np.int64), *[p[4] for p in parts]])
    ptr = np.zeros(len(counts) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum(counts)
    masks = np.concatenate([np.zeros((1, words), dtype=np.uint64), *[p[0] for p in parts]])
    cover_idx = np.concatenate([np.zeros(0, dtype=np.int64), *[p[5] for p in parts]])
    compute, params, act = (np.concatenate([zero, *[p[i] for p in parts]]) for i in (1, 2, 3))
    return Lattice(ids, masks, starts, ptr, cover_idx.astype(np.int64), compute, params, act)


def _weights(lat: Lattice, reps: FloatArray, link: Link) -> FloatArray:
    """W[r, state] = compute + 4(r-1)/(rB) params: a stage fits r replicas at t iff
    dW <= r·t - 2(r-1)·latency (:func:`_budget`)."""
    a = 4.0 * (reps - 1.0) / (reps * link.sync_bandwidth)
    return np.asarray(lat.compute_s[None, :] + a[:, None] * lat.param_bytes[None, :], dtype=np.float64)


def _budget(reps: FloatArray, tau: float, link: Link, stage_s: float = 0.0) -> FloatArray:
    """r·tau - 2(r-1)·latency - stage_s: what a stage's dW may reach on r replicas at tau, the
    all-reduce's 2(r-1) messages' latency (``stage.allreduce_time``) and the stage's own
    ``stage_s`` taken off."""
    return np.asarray(reps * tau - 2.0 * (reps - 1.0) * link.sync_latency - stage_s, dtype=np.float64)


@dataclass(frozen=True)
class _Grid:
    """The (replicas r, devices before v) pairs a probe tracks, by u = r + v <= units, then r (so a
    probe that needs at least L devices drops the column prefix before ``start[L]``)."""

    r_of: IntArray  # per pair: r - 1
    v_of: FloatArray  # per pair: v
    u_of: FloatArray  # per pair: r + v, non-decreasing
    start: IntArray  # [u]: first pair with r + v = u (u = 1 .. units + 1)

    @staticmethod
    def of(units: int, cap: int) -> _Grid:
        pairs = [(u - r, r - 1) for u in range(1, units + 1) for r in range(1, min(u, cap) + 1)]
        v_of, r_of = (np.array(x, dtype=np.int64) for x in zip(*pairs, strict=True))
        u_of = v_of + r_of + 1
        start = np.searchsorted(u_of, np.arange(units + 2))
        return _Grid(r_of, v_of.astype(np.float64), u_of.astype(np.float64), start.astype(np.int64))


@dataclass(frozen=True)
class _Sweep:
    """Per size layer, the covers laid out so each probe's maxima are slices (states visited most
    covers first); built once per search and shared by every probe."""

    order: tuple[IntArray, ...]
    cols: tuple[tuple[IntArray, ...], ...]

    @staticmethod
    def of(lat: Lattice) -> _Sweep:
        orders: list[IntArray] = [np.zeros(1, dtype=np.int64)]
        cols: list[tuple[IntArray, ...]] = [()]
        for s in range(1, len(lat.starts) - 1):
            lo, hi = int(lat.starts[s]), int(lat.starts[s + 1])
            count = np.diff(lat.cover_ptr[lo : hi + 1])
            order = np.argsort(-count, kind="stable")
            where = np.empty_like(orders[-1])
            where[orders[-1]] = np.arange(len(where))  # previous layer: state -> visiting position
            first = lat.cover_ptr[lo:hi][order]
            cover = lat.cover_idx
            prev_lo = int(lat.starts[s - 1])
            cols.append(tuple(
                where[cover[first[: int((count > c).sum())] + c] - prev_lo] for c in range(int(count.max()))
            ))  # fmt: skip
            orders.append(order)
        return _Sweep(tuple(orders), tuple(cols))


def _probe(
    lat: Lattice,
    sweep: _Sweep,
    units: int,
    link: Link,
    tau: float,
    weights: FloatArray,
    band: bool = True,
) -> FloatArray:
    """g[state]: fewest devices covering each downset with every stage at most tau (inf if none), by
    propagating the largest W_r over lower covers (float32; ``band``: drop pairs below ``_floors``)."""
    reps = np.arange(1, weights.shape[0] + 1, dtype=np.float64)
    grid = _Grid.of(units, len(reps))
    floors = _floors(lat, units, tau, weights) if band else np.ones(len(lat.starts), dtype=np.int64)
    room = link.bandwidth * (tau * reps / 2.0 - link.latency)  # cut bytes r replicas move within tau
    budget = _budget(reps, tau * (1 + 1e-12), link, lat.stage_s)[:, None]
    n, last = len(lat.masks), len(lat.masks) - 1
    g = np.full(n, np.inf)
    g[0] = 0.0
    wt = weights.T.astype(np.float32)  # [state, r]
    prev = wt[0][grid.r_of][None, :]  # the layer of the empty cut
    for s in range(1, len(lat.starts) - 1):
        lo, cols, floor = int(lat.starts[s]), sweep.cols[s], int(floors[s])
        c0, shift = int(grid.start[floor]), int(grid.start[floor] - grid.start[floors[s - 1]])
        states = lo + sweep.order[s]
        best = prev[cols[0], shift:]
        for col in cols[1:]:
            np.maximum(best[: len(col)], prev[col, shift:], out=best[: len(col)])
        need = (weights[:, states] - budget).T.astype(np.float32)  # [j, r]
        act = lat.act_bytes[states, None]
        fits = (act <= room[None, :] * (1 + 1e-12)) | (act == 0)  # nothing crossing: no message
        fits[states == last] = True
        ok = (best >= need[:, grid.r_of[c0:]]) & fits[:, grid.r_of[c0:]]
        first = ok.argmax(axis=1)  # pairs are ordered by u = r + v: the first one is the fewest
        reach = np.where(ok[np.arange(len(ok)), first], grid.u_of[c0 + first], np.inf)
        g[states] = reach
        mask = (grid.v_of[None, c0:] >= reach[:, None]) & fits[:, grid.r_of[c0:]]
        np.maximum(best, wt[states][:, grid.r_of[c0:]], out=best, where=mask)
        prev = best
    return g


def _floors(lat: Lattice, units: int, tau: float, weights: FloatArray) -> IntArray:
    """Per size layer: devices every plan at tau surely puts on each of its states and later ones
    (C_j / tau, less the float32 probe's rounding margin)."""
    margin = units * 1e-6 * float(weights[:, -1].max()) / tau + 1e-6
    lows = np.minimum.reduceat(lat.compute_s, lat.starts[:-1])
    floors = np.clip(np.ceil(lows / tau - margin), 1, units).astype(np.int64)
    floors[0] = 1
    return np.maximum.accumulate(floors)


def _stage_times(lat: Lattice, ks: IntArray, j: int, r: int, link: Link) -> FloatArray:
    act = np.where(ks > 0, lat.act_bytes[ks], 0.0)
    if j < len(lat.masks) - 1:
        act = np.maximum(act, lat.act_bytes[j])
    dc = lat.compute_s[j] - lat.compute_s[ks] + lat.stage_s
    dp = lat.param_bytes[j] - lat.param_bytes[ks]
    return stage_time(dc, dp, r, link, act=act)


def _walk(
    lat: Lattice,
    g: FloatArray,
    units: int,
    link: Link,
    tau: float,
    cap: int,
) -> list[Segment]:
    """Rebuild a plan meeting tau from g: for each stage find a fitting predecessor explicitly."""
    stages: list[Segment] = []
    j, budget = len(lat.masks) - 1, units
    while j > 0:
        near = np.flatnonzero(g[:j] <= budget - 1)  # only cuts the budget can still reach
        below = near[_inside(lat.masks[near], lat.masks[j][None, :])]  # strict subsets of j
        found = None
        for r in range(1, min(cap, budget) + 1):
            ks = below[g[below] <= budget - r]
            if len(ks) == 0:
                continue
            fit = np.flatnonzero(_stage_times(lat, ks, j, r, link) <= tau * (1 + SLACK))
            if len(fit):
                found = (int(ks[fit[0]]), r)
                break
        if found is None:
            raise RuntimeError("lattice probe and reconstruction disagree (a pipeplan bug)")
        k, r = found
        stages.append(Segment(k, j, r))
        j, budget = k, budget - r
    return stages[::-1]


def _priced(lat: Lattice, stages: list[Segment], link: Link) -> tuple[float, list[Segment]]:
    """A plan with its exact time (the slowest stage, priced on the lattice's sums)."""
    ends = [float(_stage_times(lat, np.array([s.start]), s.end, s.replicas, link)[0]) for s in stages]
    return max(ends), stages


def solve_lattice(
    lat: Lattice,
    units: int,
    link: Link,
    lower: float,
    upper: float,
    max_replicas: int | None = None,
    start: list[Segment] | None = None,
) -> tuple[float, list[Segment], float]:
    """Optimum over all downsets, between a lower bound and an attained time ``upper`` (a gallop down,
    a bisection, then descent on attained values; ``start``: a plan that attained ``upper``).

    Returns:
        (time, stages, certified lower bound).
    """
    cap = units if max_replicas is None else min(units, max_replicas)
    weights = _weights(lat, np.arange(1, cap + 1, dtype=np.float64), link)
    sweep = _Sweep.of(lat)

    def attained(tau: float) -> tuple[float, list[Segment]] | None:
        """The plan a feasible probe at tau rebuilds, with its exact time; None when infeasible."""
        g = _probe(lat, sweep, units, link, tau, weights)
        if not g[-1] <= units:
            return None
        return _priced(lat, _walk(lat, g, units, link, tau, cap), link)

    found = _priced(lat, start, link) if start else attained(upper)
    if found is None:
        raise InfeasibleError("no plan fits")
    hi, stages = found
    lo, step, bet = lower, 0.03, start is not None
    while lo < hi * (1 - step):  # gallop down from the upper plan: the optimum is usually close
        found = attained(hi * (1 - step))
        if found is None:
            lo = hi * (1 - step)
            break
        hi, stages, step, bet = *found, 2 * step, False
    while True:  # bisection, then descent; first, if the start plan held, bet that it is optimal
        close = bet or hi - lo <= 3e-3 * hi
        mid, bet = (hi * (1 - 10 * SLACK) if close else 0.5 * (lo + hi)), False
        found = attained(mid)
        if found is None:
            lo = mid
            if mid >= hi * (1 - 10 * SLACK) * (1 - SLACK):  # nothing strictly faster than hi
                return hi, stages, max(lower, mid * (1 - SLACK))
        elif found[0] <= hi:
            hi, stages = found
