"""Exact stage + replication DP over downset states, vectorised with numpy, level by level: the
slowest stage (PipeDream's objective), memory-aware. How it bounds and prunes: docs/optimizer-search.md."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from partitioner.errors import InfeasibleError
from partitioner.optimizer.pricing.memory import MemoryLimit
from partitioner.optimizer.pricing.stage import FloatArray, IntArray, stage_time
from partitioner.optimizer.search.reach import compute_floors, fewest_units, fewest_units_after, sweep_layers
from partitioner.optimizer.search.states import StateSet, csr_offsets, prefix_chain, runs, thin_prefixes
from partitioner.plan import Link

__all__ = [
    "LevelProblem",
    "Segment",
    "cut_states",
    "solve_bisection",
    "solve_bottleneck",
    "solve_direct",
]

REL_TOL = 1e-10
THIN_PREFIXES = 200  # per order, for the first upper bound on many prefix states
PAIR_BLOCK = 1 << 18  # pairs built and filtered per numpy pass


@dataclass(frozen=True)
class Segment:
    """One stage found by the DP: states (start, end], ``replicas`` units, and its inner stages."""

    start: int
    end: int
    replicas: int
    inner: tuple[Segment, ...] = ()


@dataclass(frozen=True)
class LevelProblem:
    """One level of the search.

    Attributes:
        states: the downset states.
        units: units available at this level (GPUs, or servers of GPUs).
        link: bandwidth and latency between units of this level.
        inner: devices in one unit of the level below (1 on the innermost level); PipeDream divides
            the gradient sync by it.
        base: base[k, j]-style callable giving, for state j and predecessor states K, the time of
            segment (K, j] on one unit; None = the summed compute time.
        min_replicas: smallest replica count a stage may have (synchronous-schedule candidates).
        max_replicas: largest replica count a stage may have (1 = straight pipeline).
        memory: None, or the per-device limit (``memory.MemoryLimit``).
        unit_devices: devices in one unit of this level (all levels below multiplied). A stage's
            time is at least its compute over its devices, compute / (r · unit_devices): the
            bound behind the device windows of ``solve_direct``.
    """

    states: StateSet
    units: int
    link: Link
    inner: int = 1
    base: Callable[[int | IntArray, IntArray], FloatArray] | None = None
    min_replicas: int = 1
    max_replicas: int | None = None
    memory: MemoryLimit | None = field(default=None)
    unit_devices: int = 1

    @property
    def cap(self) -> int:
        """Most replicas a stage may have: the units, or fewer under ``max_replicas``."""
        return self.units if self.max_replicas is None else min(self.units, self.max_replicas)

    def base_time(self, j: int | IntArray, ks: IntArray) -> FloatArray:
        if self.base is not None:
            return self.base(j, ks)
        return self.states.compute(ks, j)

    def held_params(self, ks: IntArray, js: IntArray) -> FloatArray:
        """Parameter bytes stages (ks, js] hold: their own and copies of tied weights owned elsewhere."""
        s = self.states
        params = np.asarray(s.param_bytes[js] - s.param_bytes[ks], dtype=np.float64)
        if self.memory is None or not self.memory.shared:
            return params
        return params + self.memory.copies(s.masks, s.layer_ids, ks, js)[0]

    def stage_time(self, k: int, j: int, r: int) -> float:
        """Time of stage (k, j] with r replicas, cut communication included."""
        _, _, base, dp, act = _Pairs.priced(
            self, np.array([k], dtype=np.int64), np.array([j], dtype=np.int64)
        )
        return float(stage_time(base, dp, r, self.link, self.inner, act)[0])


@dataclass(frozen=True)
class _Pairs:
    """Every (k, j) stage candidate of a level, flattened (CSR by j) so one numpy pass prices them all."""

    offsets: IntArray  # pairs of state j are [offsets[j], offsets[j+1])
    ks: IntArray
    base: FloatArray
    dp: FloatArray  # ΔP: the stage's parameter bytes
    act: FloatArray  # the larger of the cut traffic into and out of the stage
    params: FloatArray
    saved: FloatArray
    work: FloatArray  # what one item's backward holds beyond the saved bytes (MemoryLimit.excess)
    layers: IntArray  # states of one size are layers[i]:layers[i + 1] (no pair inside a layer)
    link: Link
    inner: int

    COLUMNS = ("ks", "base", "dp", "act", "params", "saved", "work")  # the per-pair fields, in order

    @functools.cached_property
    def q(self) -> FloatArray:
        """4·ΔP/(B·inner): the gradient-sync volume, what solving for replicas needs."""
        return _volume(self.dp, self.link, self.inner)

    @functools.cached_property
    def b(self) -> FloatArray:
        """base + q - L: the linear term of the replica quadratic (kept: every probe needs it), L
        the all-reduce's latency per step pair (:func:`_step_latency`)."""
        return np.asarray(self.base + self.q - _step_latency(self.link), dtype=np.float64)

    @functools.cached_property
    def b2(self) -> FloatArray:
        return np.asarray(self.b * self.b, dtype=np.float64)

    @staticmethod
    def of(prob: LevelProblem, upper: float = math.inf) -> _Pairs:
        """Every pair, or with a finite ``upper`` (the time of some plan) only those a plan as fast
        can use, built a block of states at a time in size order: the fewest devices reaching each
        state (``fewest_units``, each stage on the fewest replicas that meet upper) are known by
        the time its pairs are, and a pair is kept only if those before it, its own replicas and
        the compute floor after it fit the devices. NASNet's prefixes have millions of pairs and
        keep a few percent; the whole set would cost more to allocate than to use.
        """
        s, n = prob.states, len(prob.states)
        layers = s.size_layers()
        if not (math.isfinite(upper) and upper > 0):
            every = [
                _Pairs.block(prob, *_Pairs.priced(prob, ks, js), layers)
                for ks, js in s.pair_blocks(PAIR_BLOCK)
            ]
            return _Pairs.joined(n, every)
        return _Pairs.joined(n, list(_usable_blocks(prob, upper, layers)))

    @staticmethod
    def priced(
        prob: LevelProblem, ks: IntArray, js: IntArray
    ) -> tuple[IntArray, IntArray, FloatArray, FloatArray, FloatArray]:
        """(ks, js, base, ΔP, act) of the pairs: what a stage's time needs."""
        s, n = prob.states, len(prob.states)
        base = np.asarray(prob.base_time(js, ks), dtype=np.float64)
        dp = np.asarray(s.param_bytes[js] - s.param_bytes[ks], dtype=np.float64)
        act = np.where(ks > 0, s.act_bytes[ks], 0.0)
        act = np.asarray(np.maximum(act, np.where(js < n - 1, s.act_bytes[js], 0.0)), dtype=np.float64)
        return ks, js, base, dp, act

    @staticmethod
    def block(
        prob: LevelProblem, ks: IntArray, js: IntArray, base: FloatArray, dp: FloatArray, act: FloatArray,
        layers: IntArray,
    ) -> tuple[_Pairs, IntArray]:  # fmt: skip
        """Priced pairs of a run of states as a ``_Pairs`` (CSR over all states; js ascending)."""
        s, n = prob.states, len(prob.states)
        offsets = csr_offsets(js, n)
        params, saved = prob.held_params(ks, js), s.item_bytes(ks, js)
        work = _work(prob, ks, js)
        pairs = _Pairs(
            offsets, ks.astype(np.int64), base, dp, act, params, saved, work, layers, prob.link, prob.inner
        )
        return pairs, js

    @staticmethod
    def joined(n: int, parts: list[tuple[_Pairs, IntArray]]) -> _Pairs:
        """Blocks of consecutive states as one set of pairs (n >= 1: one block at least)."""
        if len(parts) == 1:
            return parts[0][0]
        offsets = csr_offsets(np.concatenate([js for _, js in parts]), n)
        ps = [p for p, _ in parts]
        ks, base, dp, act, params, saved, work = (
            np.concatenate([getattr(p, f) for p in ps]) for f in _Pairs.COLUMNS
        )
        return _Pairs(offsets, ks, base, dp, act, params, saved, work, ps[0].layers, ps[0].link, ps[0].inner)

    def subset(self, keep: npt.NDArray[np.bool_], js: IntArray | None = None) -> _Pairs:
        """The pairs where ``keep`` holds (same states, same CSR layout; ``js`` if known)."""
        js = self.js() if js is None else js
        offsets = csr_offsets(js[keep], len(self.offsets) - 1)
        ks, base, dp, act, params, saved, work = (getattr(self, f)[keep] for f in _Pairs.COLUMNS)
        return _Pairs(offsets, ks, base, dp, act, params, saved, work, self.layers, self.link, self.inner)

    def js(self) -> IntArray:
        """The later state of every pair."""
        return np.repeat(np.arange(len(self.offsets) - 1), np.diff(self.offsets))

    def times_of(self, idx: IntArray, r: FloatArray) -> FloatArray:
        """Stage times of the pairs ``idx`` with r replicas each (cut traffic included)."""
        return stage_time(self.base[idx], self.dp[idx], r, self.link, self.inner, self.act[idx])


def _step_latency(link: Link) -> float:
    """L = 2·latency: what each replica beyond the first adds to a stage's all-reduce besides its
    bytes (a ring's 2(r-1) messages, ``stage.allreduce_time``)."""
    return 2.0 * link.sync_latency


def _volume(dp: FloatArray, link: Link, inner: int) -> FloatArray:
    """4·ΔP/(B·inner): a stage's gradient-sync volume, the coefficient solving for replicas needs
    (its time on r replicas is (C + volume·(r-1)/r)/r, :func:`~.stage.stage_time`)."""
    return np.asarray(dp * (4.0 / (link.sync_bandwidth * inner)), dtype=np.float64)


def _usable_blocks(prob: LevelProblem, upper: float, layers: IntArray) -> Iterator[tuple[_Pairs, IntArray]]:
    """``_Pairs.of``'s blocks of usable pairs, with the fewest-devices DP run alongside: each block's
    states are settled once their pairs are priced, before the blocks after them are listed."""
    n = len(prob.states)
    lo, width = _windows(prob, upper)
    room = lo + width - 1  # most devices before a state's end: all but the compute floor after it
    tau = upper * (1 + 1e-9)
    g = np.full(n, np.inf)
    g[0] = 0.0
    floor = lo.astype(np.float64)  # devices surely before each state: max(g, lo) once g is known
    for ks, js in prob.states.pair_blocks(PAIR_BLOCK, _first_fits(prob, (lo, width), upper)):
        first = int(js[0]) if len(js) else n
        ks, js, base, dp, act = _Pairs.priced(prob, ks, js)
        q = _volume(dp, prob.link, prob.inner)
        ok = _replicas_floor(prob, base, q, act, tau) + floor[ks] <= room[js]  # a cheap first cut
        part, js = _Pairs.block(prob, ks[ok], js[ok], base[ok], dp[ok], act[ok], layers)
        need = _replicas_needed(prob, part, tau)
        if prob.memory is not None:  # the compute floor after each stage: devices from it on
            after = (prob.units - room)[js].astype(np.float64)
            need = np.maximum(need, _memory_floor(prob, part.params, part.saved, part.work, after))
        if len(js):
            last = int(js[-1]) + 1
            sweep_layers(g, part.ks, np.searchsorted(js, np.arange(first, last + 1)), layers, need, first)
            floor[first:last] = np.maximum(g[first:last], lo[first:last])
        keep = need + floor[part.ks] <= room[js]  # (inf: never)
        yield part.subset(keep, js), js[keep]


def _replicas_floor(
    prob: LevelProblem, base: FloatArray, q: FloatArray, act: FloatArray, tau: float
) -> FloatArray:
    """A cheap lower bound on ``_replicas_needed``: r >= (C + q/2) / tau once r >= 2 (the sync
    term is at least half its volume), and r >= 2·act / (B·tau) for the cut traffic."""
    busy = np.where(base <= tau, base, base + 0.5 * q)
    r = np.ceil(np.maximum(busy, 2.0 * act / prob.link.bandwidth) / tau * (1 - 1e-12) - 1e-9)
    return np.asarray(np.maximum(r, 1.0), dtype=np.float64)


def _replicas_needed(prob: LevelProblem, pairs: _Pairs, tau: float) -> FloatArray:
    """Fewest replicas that bring each stage down to ``tau``; inf where none can: the upper root of
    the replica quadratic and the cut traffic's need, guarded near integers (docs/optimizer-search.md)."""
    base, q, lat = pairs.base, pairs.q, _step_latency(prob.link)
    lead = tau - lat
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        root = pairs.b2 - (4.0 * lead) * q  # the discriminant, then (in place) the upper root
        flat = root <= 0  # no root: every r >= 2 meets tau
        np.sqrt(root, out=root, where=~flat)
        root += pairs.b
        root *= 1.0 / (2.0 * lead) if lead > 0 else np.inf
        root[flat] = 0.0 if lead > 0 else np.inf
        message = np.where(pairs.act > 0, prob.link.latency, 0.0)
        traffic = (pairs.act / prob.link.bandwidth + message) * (2.0 / tau)
    upper = np.ceil(root * (1 - 1e-12))
    comm = np.ceil(traffic * (1 - 1e-12))
    single = (base <= tau) & (comm <= 1) & (prob.min_replicas <= 1)
    r = np.maximum(upper, comm)
    np.maximum(r, max(2.0, prob.min_replicas), out=r)
    r[single] = 1.0
    cap = prob.cap
    r[~(r <= cap)] = np.inf  # (nan too)
    # only a root or traffic ratio within rounding of an integer can leave the closed form short
    near = (upper < root * (1 + 1e-9)) | (comm < traffic * (1 + 1e-9))
    check = np.flatnonzero(near & np.isfinite(r))
    for _ in range(3):  # guard those: bump where still too slow
        slow = check[pairs.times_of(check, r[check]) > tau * (1 + 1e-12)]
        if not len(slow):
            return r
        r[slow] = np.where(r[slow] + 1.0 <= cap, r[slow] + 1.0, np.inf)
        check = slow[np.isfinite(r[slow])]
    r[check[pairs.times_of(check, r[check]) > tau * (1 + 1e-9)]] = np.inf
    return r


def _work(prob: LevelProblem, ks: IntArray, js: IntArray) -> FloatArray:
    """Per pair, what one item's backward holds beyond the stage's saved bytes
    (:meth:`~partitioner.optimizer.pricing.memory.MemoryLimit.excess`; 0 without a limit)."""
    s = prob.states
    if prob.memory is None:
        return np.zeros(len(ks))
    return prob.memory.working_of(s.masks, s.layer_ids, ks, js, s.act_bytes[ks], s.act_bytes[js])


def _memory_capacity(prob: LevelProblem, p: FloatArray, saved: FloatArray, work: FloatArray) -> FloatArray:
    """What fits of a stage, once per pair: pipedream, the minibatches a device can hold in flight
    (< 1: none); synchronous, the fewest replicas that hold all M microbatches' activations (inf:
    none). Both from ``memory.MemoryLimit``, the one memory model; ``work``: :func:`_work`."""
    assert prob.memory is not None
    if prob.memory.asynchronous:
        return prob.memory.items(p, saved, work)
    return prob.memory.replicas(p, saved, working=work)


def _need_from(prob: LevelProblem, capacity: FloatArray, before: FloatArray) -> FloatArray:
    """Replicas stages need to fit in memory (``capacity``: their ``_memory_capacity``), ``before``
    units before them (more replicas: fewer stashed minibatches per device): pipedream's in-flight
    count is the devices from the stage on (at least 1)."""
    assert prob.memory is not None
    if not prob.memory.asynchronous:
        return capacity
    total = prob.memory.devices
    downstream = np.maximum(total - np.where(np.isfinite(before), before, total), 1.0)
    return np.where(capacity >= 1, np.ceil(downstream / np.maximum(capacity, 1.0) - 1e-9), np.inf)


def _min_units(
    prob: LevelProblem, tau: float, pairs: _Pairs | None = None, capacity: FloatArray | None = None
) -> tuple[FloatArray, IntArray, IntArray]:
    """g[j]: fewest units covering state j with stages no slower than tau, plus the argmins
    (``capacity``: the pairs' ``_memory_capacity``, if known)."""
    pairs = pairs or _Pairs.of(prob)
    n = len(prob.states)
    reps = _replicas_needed(prob, pairs, tau)
    cap = prob.cap
    if prob.memory is not None and capacity is None:
        capacity = _memory_capacity(prob, pairs.params, pairs.saved, pairs.work)
    g = np.full(n, np.inf)
    g[0] = 0.0
    arg_k = np.zeros(n, dtype=np.int64)
    arg_r = np.zeros(n, dtype=np.int64)
    for j in range(1, n):
        lo, hi = int(pairs.offsets[j]), int(pairs.offsets[j + 1])
        if lo == hi:  # (pairs a known plan's time rules out)
            continue
        gk = g[pairs.ks[lo:hi]]
        r = reps[lo:hi]
        if capacity is not None:
            r = np.maximum(r, _need_from(prob, capacity[lo:hi], gk))
            r = np.where(r <= cap, r, np.inf)
        total = gk + r
        best = int(np.argmin(total))
        if np.isfinite(total[best]):
            g[j] = total[best]
            arg_k[j] = pairs.ks[lo + best]
            arg_r[j] = int(r[best])
    return g, arg_k, arg_r


def _walk(arg_k: IntArray, arg_r: IntArray, end: int) -> list[Segment]:
    stages: list[Segment] = []
    j = end
    while j > 0:
        stages.append(Segment(int(arg_k[j]), j, int(arg_r[j])))
        j = int(arg_k[j])
    return stages[::-1]


def _plan_time(prob: LevelProblem, stages: list[Segment]) -> float:
    return max(prob.stage_time(s.start, s.end, s.replicas) for s in stages)


DIRECT_MAX_UNITS = 64


def solve_direct(
    prob: LevelProblem, pairs: _Pairs | None = None, upper: float = math.inf, lower: float = 0.0
) -> tuple[float, list[Segment]]:
    """PipeDream's recurrence, exactly: f[j, u] = min over (k, r) of max(f[k, u - r], T(k, j, r)), over
    unit counts, only in the windows a plan between ``lower`` and ``upper`` can use (exact whenever
    lower <= optimum <= upper; no memory model; docs/optimizer-search.md).

    Raises:
        InfeasibleError: no plan at all (or none as fast as ``upper``).
    """
    pairs = pairs or _Pairs.of(prob)
    n, units = len(prob.states), prob.units
    lo, width = _windows(prob, upper)
    if math.isfinite(upper) and upper > 0:
        pairs, lo, width = _between(prob, pairs, upper, lo, width)
    cand = _Candidates.of(prob, pairs, lo, width, upper, lower)
    f = np.full((n, units + 1), np.inf)
    f[0, :] = 0.0
    for u in range(1, units + 1):
        _fill_column(prob, cand, f, u)
    last = n - 1
    if not np.isfinite(f[last, units]):
        raise InfeasibleError("no plan fits")
    return float(f[last, units]), _trace(prob, cand, f)


def _windows(prob: LevelProblem, upper: float) -> tuple[IntArray, IntArray]:
    """Per state: fewest units a plan as fast as ``upper`` has before it, and how many counts to try."""
    n, units = len(prob.states), prob.units
    if not (math.isfinite(upper) and upper > 0):
        return np.zeros(n, dtype=np.int64), np.full(n, units + 1, dtype=np.int64)
    lo, after = compute_floors(prob.states.compute_s, prob.unit_devices, upper)
    return lo, np.maximum(units - after - lo + 1, 0)


def _between(
    prob: LevelProblem, pairs: _Pairs, upper: float, lo: IntArray, width: IntArray,
    need: FloatArray | None = None,
) -> tuple[_Pairs, IntArray, IntArray]:  # fmt: skip
    """The pairs and unit windows a plan as fast as ``upper`` can use (``fewest_units`` both ways, each
    stage on the fewest replicas that meet upper, or ``need``): on NASNet at 16 GPUs, 73 of 562,119."""
    units = prob.units
    need = _replicas_needed(prob, pairs, upper * (1 + 1e-9)) if need is None else need
    before = np.maximum(fewest_units(pairs.ks, pairs.offsets, pairs.layers, need, units), lo)
    after = np.maximum(
        fewest_units_after(pairs.ks, pairs.js(), pairs.layers, need, units), units + 1 - lo - width
    )
    keep = need + before[pairs.ks] + after[pairs.js()] <= units
    ok = np.isfinite(before) & np.isfinite(after)
    lo = np.where(ok, before, 0).astype(np.int64)
    width = np.maximum(np.where(ok, units - np.where(ok, after, 0) - lo + 1, 0), 0).astype(np.int64)
    return pairs.subset(keep), lo, width


def cut_states(prob: LevelProblem, upper: float) -> npt.NDArray[np.bool_]:
    """Which states some plan as fast as ``upper`` can cut at (``_between``'s windows)."""
    lo, width = _windows(prob, upper)
    return np.asarray(_between(prob, _Pairs.of(prob, upper), upper, lo, width)[2] > 0)


@dataclass(frozen=True)
class _Candidates:
    """The (pair, replicas) choices that can take part in a plan between the bounds."""

    pairs: _Pairs
    ks: IntArray  # per pair
    r_lo: IntArray
    r_hi: IntArray
    pair: IntArray  # per choice: its pair, grouped by later state
    later: IntArray  # per choice: the later state j
    reps: IntArray
    time: FloatArray
    u_lo: IntArray  # unit counts (up to and including the stage) at which the choice applies
    u_hi: IntArray

    @staticmethod
    def of(
        prob: LevelProblem, pairs: _Pairs, lo: IntArray, width: IntArray, upper: float, lower: float
    ) -> _Candidates:
        cap = prob.cap
        js, ks = pairs.js(), pairs.ks
        r_lo = np.full(len(ks), float(max(1, prob.min_replicas)))
        if math.isfinite(upper) and upper > 0:  # busy >= base / r and cut traffic 2·act / (B·r)
            with np.errstate(invalid="ignore", over="ignore"):
                need = np.maximum(pairs.base, 2.0 * pairs.act / prob.link.bandwidth) / upper
            r_lo = np.maximum(r_lo, np.ceil(np.where(np.isnan(need), np.inf, need) - 1e-9))
            r_lo = np.maximum(r_lo, _replicas_needed(prob, pairs, upper * (1 + 1e-9)))  # inf: never
        r_hi = np.minimum(cap, lo[js] + width[js] - 1 - lo[ks])
        if lower > 0:  # (1 - 1e-9): a count that meets slightly less than lower surely meets the optimum
            most = _replicas_needed(prob, pairs, lower * (1 - 1e-9))
            r_hi = np.minimum(r_hi, np.where(np.isfinite(most), most, cap).astype(np.int64))
        keep = (width[js] > 0) & (width[ks] > 0) & (r_lo <= r_hi)
        sub = pairs.subset(keep)
        r_lo_k = r_lo[keep].astype(np.int64)
        r_hi_k = r_hi[keep]
        pair, reps = runs(r_lo_k, r_hi_k - r_lo_k + 1)
        k, j = sub.ks[pair], js[keep][pair]
        u_lo = np.maximum(lo[j], lo[k] + reps)
        u_hi = np.minimum(lo[j] + width[j], lo[k] + width[k] + reps) - 1
        time = sub.times_of(pair, reps.astype(np.float64))
        return _Candidates(sub, sub.ks, r_lo_k, r_hi_k, pair, j, reps, time, u_lo, u_hi)


def _fill_column(prob: LevelProblem, cand: _Candidates, f: FloatArray, u: int) -> None:
    """f[:, u] from the columns before it: every choice that applies at u, one numpy pass."""
    active = np.flatnonzero((cand.u_lo <= u) & (u <= cand.u_hi))
    if not len(active):
        return
    pair = cand.pair[active]
    cols = f.shape[1]
    val = np.maximum(f.ravel()[cand.ks[pair] * cols + (u - cand.reps[active])], cand.time[active])
    js = cand.later[active]
    starts = np.flatnonzero(np.diff(js, prepend=-1))  # choices are grouped by j
    f[js[starts], u] = np.minimum.reduceat(val, starts)


def _trace(prob: LevelProblem, cand: _Candidates, f: FloatArray) -> list[Segment]:
    """Rebuild the stages: at each state, the first (k, r) that attains f (k, then r, ascending)."""
    stages: list[Segment] = []
    j, u = len(f) - 1, prob.units
    offsets = cand.pairs.offsets
    while j > 0:
        idx = np.arange(offsets[j], offsets[j + 1])
        reps = np.arange(1, u + 1)
        ok = (reps[None, :] >= cand.r_lo[idx, None]) & (reps[None, :] <= cand.r_hi[idx, None])
        t = cand.pairs.times_of(idx[:, None], np.broadcast_to(reps, (len(idx), u)).astype(np.float64))
        ks = cand.ks[idx]
        val = np.where(ok, np.maximum(f[ks[:, None], u - reps[None, :]], t), np.inf)
        hit = np.flatnonzero(val.ravel() <= f[j, u])
        if not len(hit):
            raise RuntimeError("direct DP and its trace disagree (a pipeplan bug)")
        row, col = divmod(int(hit[0]), u)
        stages.append(Segment(int(ks[row]), j, int(reps[col])))
        j, u = int(ks[row]), u - int(reps[col])
    return stages[::-1]


def _chain_upper(prob: LevelProblem, most: int = 48) -> float:
    """Time of the best plan cut only at prefixes of the layer order, thinned to ``most`` cuts: an
    attained upper bound for the windows, found on a few hundred pairs."""
    chain = prefix_chain(prob.states, most)
    if chain is None:
        return math.inf
    idx, states = chain
    try:
        return solve_direct(replace(prob, states=states, base=_renumbered(prob.base, idx)))[0]
    except InfeasibleError:
        return math.inf


def _renumbered(
    base: Callable[[int | IntArray, IntArray], FloatArray] | None, idx: IntArray
) -> Callable[[int | IntArray, IntArray], FloatArray] | None:
    """A level's segment times for a subset ``idx`` of its states, numbered 0.. in that order."""
    if base is None:
        return None
    full = base
    return lambda j, ks: full(idx[j], idx[ks])


def _first_fits(
    prob: LevelProblem, windows: tuple[IntArray, IntArray], upper: float
) -> tuple[IntArray, IntArray]:
    """Per state, (need, room): a plan as fast as ``upper`` uses pair (k, j) only if need[k] <= room[j]
    (cut traffic and compute floors; the pairs that fail are never listed: 72% on NASNet at 16 GPUs)."""
    lo, width = windows
    cap = prob.cap
    act = prob.states.act_bytes.copy()
    act[0] = 0.0  # the model's inputs are free
    r = np.maximum(np.ceil(2.0 * act / prob.link.bandwidth / upper - 1e-9), 1)
    far = np.iinfo(np.int64).max // 2
    need = np.where((width > 0) & (r <= cap), lo + np.minimum(r, cap).astype(np.int64), far)
    room = np.where(width > 0, lo + width - 1, -1)
    return need.astype(np.int64), room.astype(np.int64)


def solve_bottleneck(prob: LevelProblem, lower: float = 0.0) -> tuple[float, list[Segment], float]:
    """Minimise the slowest stage at this level; returns (time, stages, certified lower bound).

    Few units: the direct recurrence without the memory limit, bounded by a quick plan over prefixes;
    else (or when its plan does not fit) a bisection with the memory-aware fewest-units DP.

    Raises:
        InfeasibleError: no plan fits, even with unlimited time (memory too small).
    """
    thin = thin_prefixes(prob.states, THIN_PREFIXES) if prob.base is None else None
    if prob.units <= DIRECT_MAX_UNITS:
        free = replace(prob, memory=None)
        upper = _chain_upper(free)
        if thin is not None:  # a closer upper bound first: far fewer pairs can beat it
            upper = min(upper, solve_bottleneck(replace(free, states=thin))[0])
        try:
            time, stages = solve_direct(free, _Pairs.of(free, upper), upper, lower)
        except InfeasibleError:  # only if the bounds were wrong: search without them
            return solve_bisection(prob, lower)
        if prob.memory is None or _fits_memory(prob, stages):
            return time, stages, time
        lower = max(lower, time * (1 - 1e-12))
    # a plan that fits, on fewer cuts (many units: the same, from the plans on thinned prefixes):
    # only the pairs a plan as fast can use are searched
    upper = _fitting_upper(prob, lower, thin)
    return solve_bisection(prob, lower, _Pairs.of(prob, upper) if math.isfinite(upper) else None)


def _fitting_upper(prob: LevelProblem, lower: float, thin: StateSet | None) -> float:
    """Time of the best memory-fitting plan cut only at thinned prefixes (inf if none fits)."""
    if prob.base is not None:  # (memory limits are flat: no segment times to renumber)
        return math.inf
    subsets = [] if thin is None else [thin]
    chain = prefix_chain(prob.states)
    subsets += [] if chain is None else [chain[1]]
    best = math.inf
    for states in subsets:
        with contextlib.suppress(InfeasibleError):
            best = min(best, solve_bisection(replace(prob, states=states), lower)[0])
    return best


def _fits_memory(prob: LevelProblem, stages: list[Segment]) -> bool:
    """Whether every stage has the replicas ``_min_units`` would demand for memory."""
    s = prob.states
    k = np.array([x.start for x in stages], dtype=np.int64)
    j = np.array([x.end for x in stages], dtype=np.int64)
    r = np.array([x.replicas for x in stages], dtype=np.float64)
    before = np.concatenate([[0.0], np.cumsum(r)[:-1]])
    capacity = _memory_capacity(prob, prob.held_params(k, j), s.item_bytes(k, j), _work(prob, k, j))
    need = _need_from(prob, capacity, before)
    return bool((r >= need).all())


def solve_bisection(
    prob: LevelProblem, lower: float = 0.0, pairs: _Pairs | None = None
) -> tuple[float, list[Segment], float]:
    """Bisection on the slowest stage's time; each probe is the fewest-units DP (memory-aware)."""
    pairs = pairs or _Pairs.of(prob)
    last = len(prob.states) - 1
    capacity = None if prob.memory is None else _memory_capacity(prob, pairs.params, pairs.saved, pairs.work)
    g, arg_k, arg_r = _min_units(prob, math.inf, pairs, capacity)
    if not g[last] <= prob.units:
        raise InfeasibleError("no plan fits in memory")
    best = _walk(arg_k, arg_r, last)
    hi = _plan_time(prob, best)
    lo = min(lower, hi)
    pruned_at = math.inf
    while hi - lo > REL_TOL * hi:
        if hi < 0.99 * pruned_at and prob.units <= DIRECT_MAX_UNITS and prob.base is None:
            pairs, pruned_at = _usable(prob, pairs, hi), hi  # what a plan as fast as hi can use
            capacity = (
                None if prob.memory is None else _memory_capacity(prob, pairs.params, pairs.saved, pairs.work)
            )
        mid = 0.5 * (lo + hi)
        g, arg_k, arg_r = _min_units(prob, mid, pairs, capacity)
        if g[last] <= prob.units:
            best = _walk(arg_k, arg_r, last)
            hi = min(_plan_time(prob, best), mid)
        else:
            lo = mid
    return hi, best, lo


def _usable(prob: LevelProblem, pairs: _Pairs, upper: float) -> _Pairs:
    """The pairs a plan as fast as ``upper`` that fits the memory limit can use (``_between``):
    each stage on at least the replicas that meet upper and ``_memory_floor``'s, with the fewest
    devices after it that the time alone asks for."""
    free = replace(prob, memory=None)
    lo, width = _windows(free, upper)
    need = _replicas_needed(free, pairs, upper * (1 + 1e-9))
    if prob.memory is not None:
        after = fewest_units_after(pairs.ks, pairs.js(), pairs.layers, need, prob.units)[pairs.js()]
        need = np.maximum(need, _memory_floor(prob, pairs.params, pairs.saved, pairs.work, after))
    return _between(free, pairs, upper, lo, width, need)[0]


def _memory_floor(
    prob: LevelProblem, params: FloatArray, saved: FloatArray, work: FloatArray, after: FloatArray
) -> FloatArray:
    """Fewest replicas stages need for memory whatever comes before them, given at least ``after``
    devices after each: pipedream's in-flight count is at least r + after, so r >= after / (h - 1)
    (h: the minibatches that fit, ``_memory_capacity``); synchronous schedules' need is fixed."""
    capacity = _memory_capacity(prob, params, saved, work)
    if prob.memory is None or not prob.memory.asynchronous:
        return capacity
    with np.errstate(divide="ignore", invalid="ignore"):
        floor = np.where(capacity >= 2, np.ceil(after / (capacity - 1) - 1e-9), np.inf)
    return np.asarray(np.where((capacity >= 1) & (after <= 0), 1.0, floor), dtype=np.float64)
