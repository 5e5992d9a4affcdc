"""Exact stage + replication DP over downset states, vectorised with numpy, level by level.

The final level minimises the slowest stage (PipeDream's objective) by bisection on that time:
for a candidate time t, ``_min_units`` computes the fewest devices that cover each downset with stages
no slower than t (the replicas a stage needs at time t have a closed form, so each state is one numpy
pass over its predecessor states). Each feasible t is tightened to the plan's real time, so the search
ends on an attained value with a certified lower bound (the largest infeasible t). Inner levels of a
hierarchy (servers made of GPUs) need the best time of *every* segment on one unit, as PipeDream's
recursion does; ``_all_segments`` fills that table one unit count at a time, every segment at once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from partitioner.errors import InfeasibleError
from partitioner.optimizer.states import StateSet

__all__ = [
    "LevelProblem",
    "Segment",
    "solve_bisection",
    "solve_bottleneck",
    "solve_direct",
    "solve_hierarchy",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
REL_TOL = 1e-10


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
        bandwidth: bytes/s between units of this level.
        inner: devices in one unit of the level below (1 on the innermost level); PipeDream divides
            the gradient sync by it.
        base: base[k, j]-style callable giving, for state j and predecessor states K, the time of
            segment (K, j] on one unit; None = the summed compute time.
        min_replicas: smallest replica count a stage may have (synchronous-schedule candidates).
        max_replicas: largest replica count a stage may have (1 = straight pipeline).
        memory: None, or (limit bytes, optimizer state factor, schedule, total devices).
        unit_devices: devices in one unit of this level (all levels below multiplied). A stage's
            time is at least its compute over its devices, compute / (r · unit_devices): the
            bound behind the device windows of ``solve_direct``.
    """

    states: StateSet
    units: int
    bandwidth: float
    inner: int = 1
    base: Callable[[int | IntArray, IntArray], FloatArray] | None = None
    min_replicas: int = 1
    max_replicas: int | None = None
    memory: tuple[float, int, str, int] | None = field(default=None)
    unit_devices: int = 1

    def base_time(self, j: int | IntArray, ks: IntArray) -> FloatArray:
        if self.base is not None:
            return self.base(j, ks)
        c = self.states.compute_s
        return np.asarray(c[j] - c[ks], dtype=np.float64)

    def stage_time(self, k: int, j: int, r: int) -> float:
        """Time of stage (k, j] with r replicas, cut communication included."""
        ks = np.array([k], dtype=np.int64)
        return float(self._times(j, ks, np.array([float(r)]))[0])

    def _times(self, j: int, ks: IntArray, r: FloatArray) -> FloatArray:
        s = self.states
        dp = s.param_bytes[j] - s.param_bytes[ks]
        sync = 4.0 * (r - 1.0) * dp / (self.bandwidth * r) / self.inner
        busy = (self.base_time(j, ks) + sync) / r
        act = np.where(ks > 0, s.act_bytes[ks], 0.0)
        if j < len(s) - 1:
            act = np.maximum(act, s.act_bytes[j])
        return np.asarray(np.maximum(busy, 2.0 * act / (self.bandwidth * r)), dtype=np.float64)


@dataclass(frozen=True)
class _Pairs:
    """Every (k, j) stage candidate of a level, flattened (CSR by j) so one numpy pass prices them all."""

    offsets: IntArray  # pairs of state j are [offsets[j], offsets[j+1])
    ks: IntArray
    base: FloatArray
    q: FloatArray  # 4·ΔP/(B·inner): the gradient-sync volume term
    act: FloatArray  # the larger of the cut traffic into and out of the stage
    params: FloatArray
    saved: FloatArray

    @staticmethod
    def of(prob: LevelProblem) -> _Pairs:
        s, n = prob.states, len(prob.states)
        ks_list = [prob.states.pred(j) for j in range(n)]
        offsets = np.zeros(n + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(k) for k in ks_list])
        ks = np.concatenate(ks_list).astype(np.int64)
        js = np.repeat(np.arange(n), [len(k) for k in ks_list])
        base = prob.base_time(js, ks) if len(ks) else ks * 0.0
        params = s.param_bytes[js] - s.param_bytes[ks]
        act = np.where(ks > 0, s.act_bytes[ks], 0.0)
        act = np.maximum(act, np.where(js < n - 1, s.act_bytes[js], 0.0))
        q = 4.0 * params / (prob.bandwidth * prob.inner)
        return _Pairs(offsets, ks, np.asarray(base, dtype=np.float64), q, act, params,
                      s.saved_bytes[js] - s.saved_bytes[ks])  # fmt: skip

    def subset(self, keep: npt.NDArray[np.bool_]) -> _Pairs:
        """The pairs where ``keep`` holds (same states, same CSR layout)."""
        offsets = np.zeros_like(self.offsets)
        offsets[1:] = np.cumsum(np.bincount(self.js()[keep], minlength=len(self.offsets) - 1))
        return _Pairs(offsets, self.ks[keep], self.base[keep], self.q[keep], self.act[keep],
                      self.params[keep], self.saved[keep])  # fmt: skip

    def js(self) -> IntArray:
        """The later state of every pair."""
        return np.repeat(np.arange(len(self.offsets) - 1), np.diff(self.offsets))

    def times(self, r: FloatArray, bandwidth: float) -> FloatArray:
        busy = (self.base + self.q * (r - 1.0) / r) / r
        return np.asarray(np.maximum(busy, 2.0 * self.act / (bandwidth * r)), dtype=np.float64)


def _replicas_needed(prob: LevelProblem, pairs: _Pairs, tau: float) -> FloatArray:
    """Fewest replicas that bring each stage down to ``tau``; inf where none can.

    With r replicas a stage takes (C + q(r-1)/r)/r: r = 1 works when C <= tau, and r >= 2 works
    exactly when r is at least the upper root of tau·r² - (C+q)·r + q (the sync term makes small
    replications slower, so the feasible set is {1} plus everything from that root on). Cut traffic
    needs r >= 2·act/(B·tau).
    """
    base, q = pairs.base, pairs.q
    b = base + q
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        disc = b * b - 4.0 * tau * q
        upper = np.where(
            disc > 0, np.ceil((b + np.sqrt(np.maximum(disc, 0.0))) / (2.0 * tau) * (1 - 1e-12)), 1.0
        )
        comm = np.ceil(2.0 * pairs.act / (prob.bandwidth * tau) * (1 - 1e-12))
    single = (base <= tau) & (comm <= 1) & (prob.min_replicas <= 1)
    r = np.where(single, 1.0, np.maximum(np.maximum(upper, comm), max(2.0, prob.min_replicas)))
    r = np.where(np.isnan(r), np.inf, r)
    cap = prob.units if prob.max_replicas is None else min(prob.units, prob.max_replicas)
    r = np.where(r <= cap, r, np.inf)
    for _ in range(3):  # guard the closed form against rounding: bump where still too slow
        with np.errstate(invalid="ignore"):
            slow = np.isfinite(r) & (pairs.times(r, prob.bandwidth) > tau * (1 + 1e-12))
        if not slow.any():
            break
        r = np.where(slow, np.where(r + 1.0 <= cap, r + 1.0, np.inf), r)
    with np.errstate(invalid="ignore"):
        slow = np.isfinite(r) & (pairs.times(r, prob.bandwidth) > tau * (1 + 1e-9))
    return np.where(slow, np.inf, r)


def _memory_replicas(prob: LevelProblem, pairs: _Pairs, lo: int, hi: int, gk: FloatArray) -> FloatArray:
    """Replicas a stage needs to fit in memory (more replicas: fewer stashed minibatches per device)."""
    assert prob.memory is not None
    limit, opt, schedule, total = prob.memory
    p, saved = pairs.params[lo:hi], pairs.saved[lo:hi]
    if schedule == "pipedream":  # weights + (h-1) stashed versions + h activations <= limit
        hmax = np.floor((limit - p * (1 + opt)) / np.maximum(p + saved, 1e-9))
        downstream = np.maximum(total - np.where(np.isfinite(gk), gk, total), 1.0)
        return np.where(hmax >= 1, np.ceil(downstream / np.maximum(hmax, 1.0) - 1e-9), np.inf)
    room = limit - p * (2 + opt)  # synchronous: at most all M microbatches' activations
    return np.where(room > 0, np.ceil(saved / np.maximum(room, 1e-9) - 1e-9), np.inf)


def _min_units(
    prob: LevelProblem, tau: float, pairs: _Pairs | None = None
) -> tuple[FloatArray, IntArray, IntArray]:
    """g[j]: fewest units covering state j with stages no slower than tau, plus the argmins."""
    pairs = pairs or _Pairs.of(prob)
    n = len(prob.states)
    reps = _replicas_needed(prob, pairs, tau)
    cap = prob.units if prob.max_replicas is None else min(prob.units, prob.max_replicas)
    g = np.full(n, np.inf)
    g[0] = 0.0
    arg_k = np.zeros(n, dtype=np.int64)
    arg_r = np.zeros(n, dtype=np.int64)
    chain = prob.states.preds is None
    for j in range(1, n):
        lo, hi = int(pairs.offsets[j]), int(pairs.offsets[j + 1])
        gk = g[:j] if chain else g[pairs.ks[lo:hi]]
        r = reps[lo:hi]
        if prob.memory is not None:
            r = np.maximum(r, _memory_replicas(prob, pairs, lo, hi, gk))
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
BLOCK_ELEMENTS = 400_000


def solve_direct(
    prob: LevelProblem, pairs: _Pairs | None = None, upper: float = math.inf, lower: float = 0.0
) -> tuple[float, list[Segment]]:
    """PipeDream's recurrence, exactly: f[j, u] = min over (k, r) of max(f[k, u - r], T(k, j, r)).

    ``f[k, u]`` is the best time of state k on at most u units. Column u only needs columns < u,
    so the DP runs over unit counts, each step vectorised over every pair at once. Given the time
    ``upper`` of some plan, only plans at least as fast matter, and in those every stage of r
    replicas carries at most r · unit_devices · upper of compute: the cut at state j then has at
    least ceil(w_j / upper) units before it and ceil((w_N - w_j) / upper) after it
    (w = compute / unit_devices), so f[j, u] is only computed for u in that window (``_windows``),
    and a pair only with replica counts that can meet ``upper``. Given a lower bound on the
    optimum, some optimal plan gives each stage the fewest replicas that meet the optimum, which
    is no more than the fewest that meet ``lower``: that caps every pair's replicas. Exact
    whenever ``lower`` <= optimum <= ``upper``; no memory model (the bisection has one).

    Raises:
        InfeasibleError: no plan at all (or none as fast as ``upper``).
    """
    pairs = pairs or _Pairs.of(prob)
    n, units = len(prob.states), prob.units
    cand = _Candidates.of(prob, pairs, *_windows(prob, upper), upper, lower)
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
    w = prob.states.compute_s / (prob.unit_devices * upper)
    before = np.maximum(np.ceil(w - 1e-9), 0.0)  # 1e-9: a plan exactly at upper stays inside
    after = np.maximum(np.ceil((w[-1] - w) - 1e-9), 0.0)
    before[0] = 0.0
    lo = before.astype(np.int64)
    return lo, np.maximum(units - after.astype(np.int64) - lo + 1, 0)


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
        cap = prob.units if prob.max_replicas is None else min(prob.units, prob.max_replicas)
        js, ks = pairs.js(), pairs.ks
        r_lo = np.full(len(ks), float(max(1, prob.min_replicas)))
        if math.isfinite(upper) and upper > 0:  # busy >= base / r and cut traffic 2·act / (B·r)
            with np.errstate(invalid="ignore", over="ignore"):
                need = np.maximum(pairs.base, 2.0 * pairs.act / prob.bandwidth) / upper
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
        count = r_hi_k - r_lo_k + 1
        pair = np.repeat(np.arange(len(sub.ks)), count)
        first = np.cumsum(count) - count
        reps = r_lo_k[pair] + (np.arange(len(pair)) - first[pair])
        k, j = sub.ks[pair], js[keep][pair]
        u_lo = np.maximum(lo[j], lo[k] + reps)
        u_hi = np.minimum(lo[j] + width[j], lo[k] + width[k] + reps) - 1
        time = _pair_times(prob, sub, pair, reps.astype(np.float64)[:, None])[:, 0]
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


def _pair_times(prob: LevelProblem, pairs: _Pairs, idx: IntArray, r: FloatArray) -> FloatArray:
    """Stage time of pairs ``idx`` with r replicas (r is [pair, ...]), as PipeDream prices it."""
    busy = (pairs.base[idx, None] + pairs.q[idx, None] * (r - 1.0) / r) / r
    return np.asarray(np.maximum(busy, 2.0 * pairs.act[idx, None] / (prob.bandwidth * r)), dtype=np.float64)


def _trace(prob: LevelProblem, cand: _Candidates, f: FloatArray) -> list[Segment]:
    """Rebuild the stages: at each state, the first (k, r) that attains f (k, then r, ascending)."""
    stages: list[Segment] = []
    j, u = len(f) - 1, prob.units
    offsets = cand.pairs.offsets
    while j > 0:
        idx = np.arange(offsets[j], offsets[j + 1])
        reps = np.arange(1, u + 1)
        ok = (reps[None, :] >= cand.r_lo[idx, None]) & (reps[None, :] <= cand.r_hi[idx, None])
        t = _pair_times(prob, cand.pairs, idx, np.broadcast_to(reps, (len(idx), u)).astype(np.float64))
        ks = cand.ks[idx]
        val = np.where(ok, np.maximum(f[ks[:, None], u - reps[None, :]], t), np.inf)
        hit = np.flatnonzero(val.ravel() <= f[j, u])
        if not len(hit):
            raise RuntimeError("direct DP and its trace disagree (a pipeplan bug)")
        row, col = divmod(int(hit[0]), u)
        stages.append(Segment(int(ks[row]), j, int(reps[col])))
        j, u = int(ks[row]), u - int(reps[col])
    return stages[::-1]


def _chain_upper(prob: LevelProblem, pairs: _Pairs, most: int = 48) -> float:
    """Time of the best plan cut only at prefixes of the layer order, thinned to ``most`` cuts.

    Prefixes are downsets, so that plan is one the full search also considers: its time is an
    attained upper bound for the windows, found on a few hundred pairs.
    """
    masks = prob.states.masks
    prefix = np.array([m & (m + 1) == 0 for m in masks])
    idx = np.flatnonzero(prefix)
    if len(idx) < 2 or idx[-1] != len(masks) - 1:
        return math.inf
    if len(idx) > most:
        c = prob.states.compute_s[idx]
        pick = np.searchsorted(c, np.linspace(0.0, c[-1], most))
        idx = idx[sorted({0, len(idx) - 1, *np.minimum(pick, len(idx) - 1).tolist()})]
    chosen = np.zeros(len(masks), dtype=bool)
    chosen[idx] = True
    sub = pairs.subset(chosen[pairs.ks] & chosen[pairs.js()])
    try:
        return solve_direct(prob, sub)[0]
    except InfeasibleError:
        return math.inf


def _reachable(prob: LevelProblem, pairs: _Pairs, tau: float) -> bool:
    """Whether some plan has every stage at most tau: fewest units, vectorised over unit counts."""
    need = _replicas_needed(prob, pairs, tau)
    ok = np.isfinite(need)
    ks, js, r = pairs.ks[ok], pairs.js()[ok], need[ok].astype(np.int64)
    n, units = len(prob.states), prob.units
    if not len(ks):
        return n == 1
    reach = np.zeros((n, units + 1), dtype=bool)  # reach[j, u]: state j on at most u units
    reach[0, :] = True
    starts = np.flatnonzero(np.diff(js, prepend=-1))
    where = js[starts]
    for u in range(1, units + 1):
        hit = (r <= u) & reach[ks, np.maximum(u - r, 0)]
        reach[where, u] = np.logical_or.reduceat(hit, starts)
        if reach[n - 1, u]:
            return True
    return False


def _narrow(prob: LevelProblem, pairs: _Pairs, lower: float, upper: float) -> tuple[float, float]:
    """Bounds on the optimum within 5% of each other: decision probes galloping down from upper.

    Probe tolerances are kept on the safe side: a feasible tau gives upper = tau (1 + 1e-8),
    an infeasible one lower = tau (1 - 1e-9).
    """
    lo, hi, step = lower, upper, 0.01
    for _ in range(8):
        if not (math.isfinite(hi) and hi > lo * 1.05):
            break
        tau = hi * (1 - step) if lo < hi * (1 - step) * 0.97 else math.sqrt(lo * hi)
        if _reachable(prob, pairs, tau):
            hi, step = min(hi, tau * (1 + 1e-8)), 2 * step
        else:
            lo = max(lo, tau * (1 - 1e-9))
    return lo, hi


def solve_bottleneck(prob: LevelProblem, lower: float = 0.0) -> tuple[float, list[Segment], float]:
    """Minimise the slowest stage at this level; returns (time, stages, certified lower bound).

    Few units and no memory limit: the direct recurrence (exact, bound = the optimum), bounded by
    a quick plan over prefixes and decision probes that bring lower and upper bounds within 5%.
    Otherwise (or if those bounds ever failed) bisection on the time with the fewest-units DP.

    Raises:
        InfeasibleError: no plan fits, even with unlimited time (memory too small).
    """
    pairs = _Pairs.of(prob)
    if prob.memory is None and prob.units <= DIRECT_MAX_UNITS:
        low, upper = _narrow(prob, pairs, lower, _chain_upper(prob, pairs))
        try:
            time, stages = solve_direct(prob, pairs, upper, low)
            return time, stages, time
        except InfeasibleError:  # only if the bounds were wrong: search without them
            pass
    return solve_bisection(prob, lower, pairs)


def solve_bisection(
    prob: LevelProblem, lower: float = 0.0, pairs: _Pairs | None = None
) -> tuple[float, list[Segment], float]:
    """Bisection on the slowest stage's time; each probe is the fewest-units DP (memory-aware)."""
    pairs = pairs or _Pairs.of(prob)
    last = len(prob.states) - 1
    g, arg_k, arg_r = _min_units(prob, math.inf, pairs)
    if not g[last] <= prob.units:
        raise InfeasibleError("no plan fits in memory")
    best = _walk(arg_k, arg_r, last)
    hi = _plan_time(prob, best)
    lo = min(lower, hi)
    while hi - lo > REL_TOL * hi:
        mid = 0.5 * (lo + hi)
        g, arg_k, arg_r = _min_units(prob, mid, pairs)
        if g[last] <= prob.units:
            best = _walk(arg_k, arg_r, last)
            hi = min(_plan_time(prob, best), mid)
        else:
            lo = mid
    return hi, best, lo


# ---------------------------------------------------------------- hierarchy


@dataclass(frozen=True)
class _Tables:
    """Best time of every segment (i, j] of one level on up to m units.

    ``opened[m]`` (m < units): the segment's last stage pays for its output (it ends at an internal
    cut of a longer segment); ``closed``: on all the level's units, the output is the next level's
    to charge. Entries above the level's ceiling are inf (no plan as fast as the bound uses them).
    How each best splits is not stored: ``_unfold`` recomputes it for the few segments a plan uses.
    """

    prob: LevelProblem
    opened: FloatArray  # [m, i, j]; m = 0 unused
    closed: FloatArray  # [i, j]


@dataclass(frozen=True)
class _Top:
    """The last level, as seen from the level below it (for the ceilings of its tables)."""

    units: int
    cap: int  # most replicas a top stage may have
    unit_devices: int  # devices in one top-level unit
    bandwidth: float
    inner: int  # devices of the level below in one top-level unit (PipeDream divides the sync by it)


def _all_segments(
    prob: LevelProblem, ceiling: float = math.inf, top: _Top | None = None, search: str = "auto"
) -> _Tables:
    """Direct DP over all segments at once (PipeDream's non-final level), one unit count at a time.

    A segment (i, j] on m units is one stage (i, j] or a segment (i, k] on m - r units followed
    by stage (k, j] on r. Entries on m units only read tables on fewer units, so every (i, j) of
    one unit count is filled together: a few balanced splits per entry first (a tight bound),
    then every split that can still beat the entry's best so far (or its ceiling), listed
    sparsely (``_Splits``). Rows whose compute alone (spread over the units) exceeds ``ceiling``
    are skipped: the next level cannot use anything slower. ``top`` = the level above when it is
    the last one and ``ceiling`` is its attained time: a top stage from i can then have at most
    units - (units before i) replicas (before i: at least its compute over devices per unit x
    ceiling), and on R replicas it pays the gradient sync of its parameters, both of which lower
    the ceiling of row i (``_limits``). ``search``: how splits are listed (``_Splits``; tests
    pin "window" or "column", both exact).
    """
    n, units = len(prob.states), prob.units
    cap = units if prob.max_replicas is None else min(units, prob.max_replicas)
    opened = np.full((units, n, n), np.inf)
    closed = np.full((n, n), np.inf)
    before, after = _top_windows(prob, ceiling, top)
    pairs = _LevelPairs.of(prob, cap, ceiling, top, before, after)
    splits = _Splits.of(prob, pairs, search)
    prior: dict[int, _Prior] = {}  # opened[u] with its search structures, once complete
    for m in range(1, units + 1):
        out = m < units
        limit = pairs.limit[out]
        best = np.full(n * n, np.inf)
        best[splits.flat] = pairs.grid[out, False][: min(m, cap)].min(axis=0)
        keep = pairs.span <= m * limit * prob.unit_devices
        cells = splits.flat[keep]
        reps = range(1, min(m - 1, cap) + 1)
        lasts = {r: splits.dense(pairs.grid[out, True][r - 1]) for r in reps}
        for r in reps:
            splits.probe(best, prior[m - r].table, lasts[r], (m - r, r), cells)
        for r in reps:
            bound = np.full(n * n, -np.inf)  # what a split must meet; -inf: the entry takes none
            bound[cells] = np.minimum(best[cells], limit[keep])
            splits.fold(best, bound, prior[m - r], lasts[r], (m - r, r), cells)
        best = best[splits.flat]
        best[best > limit] = np.inf
        table = opened[m] if out else closed
        table[pairs.ks, splits.js] = best
        prior[m] = _Prior(table, splits.order)
    return _Tables(prob, opened, closed)


@dataclass(frozen=True)
class _LevelPairs:
    """Every (k, j) pair of a level (CSR by j) with its stage times and ceilings, computed at once.

    ``grid[charge_out, charge_in]`` is [replicas, pair], as ``_segment_grid`` prices it per j;
    ``limit[charge_out]`` is ``_limits`` of the pair's start (after = 0 for open segments).
    """

    offsets: IntArray
    ks: IntArray
    span: FloatArray
    grid: dict[tuple[bool, bool], FloatArray]
    limit: dict[bool, FloatArray]

    @staticmethod
    def of(
        prob: LevelProblem, cap: int, ceiling: float, top: _Top | None, before: IntArray, after: IntArray
    ) -> _LevelPairs:
        s, n = prob.states, len(prob.states)
        ks_list = [s.pred(j) for j in range(n)]
        offsets = np.zeros(n + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(k) for k in ks_list])
        ks = np.concatenate(ks_list).astype(np.int64)
        js = np.repeat(np.arange(n), np.diff(offsets))
        params = s.param_bytes[js] - s.param_bytes[ks]
        r = np.arange(1, cap + 1, dtype=np.float64)[:, None]
        sync = 4.0 * (r - 1.0) * params / (prob.bandwidth * r) / prob.inner
        t = (prob.base_time(js, ks) + sync) / r
        act_in = np.where(ks > 0, s.act_bytes[ks], 0.0)
        act_out = np.where(js < n - 1, s.act_bytes[js], 0.0)
        grid = {}
        for out in (False, True):
            for into in (False, True):
                act = np.maximum(act_in if into else 0.0, act_out if out else 0.0)
                grid[out, into] = np.asarray(
                    np.maximum(t, 2.0 * act / (prob.bandwidth * r)), dtype=np.float64
                )
        limit = {True: _limits(ceiling, top, before[ks], 0, params),
                 False: _limits(ceiling, top, before[ks], after[js], params)}  # fmt: skip
        return _LevelPairs(offsets, ks, s.compute_s[js] - s.compute_s[ks], grid, limit)


CHUNK = 1 << 16  # splits priced per numpy pass: big enough to amortise calls, small enough for cache


@dataclass(frozen=True)
class _Splits:
    """Finds the splits (i, k, j) of one level that can meet a bound, two ways, cheaper per end j.

    By compute window: a segment on u units and a stage on r replicas both take at least their
    compute over their devices, so k can meet an entry's bound b only if c_k lies in
    [c_j - r·d·b, c_i + u·d·b] (d devices per unit), a range of the states sorted by compute.
    By column: k such that the stage (k, j] and some entry (., k) of the first table both meet
    the largest bound of end j (``_SortedTable``). The first is tight where compute dominates
    (CNNs), the second where many states share their compute or communication dominates (GNMT).
    Tables are flat: entry (i, j) at i·n + j.
    """

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
        the four states around it in compute order are tried (any split is a valid plan).
        """
        n, c = self.n, self.compute
        i, j = cells // n, cells % n
        mid = c[i] + (c[j] - c[i]) * (units[0] / (units[0] + units[1]))
        at = np.searchsorted(c[self.order], mid)
        value = best[cells]  # cells are distinct: no ufunc.at needed
        for shift in (-2, -1, 0, 1):
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
        hi = first.reach.count(i, b)
        slack = 1e-9 * (abs(float(self.compute[-1])) + 1e-30)  # the compute bounds are not rounded
        sorted_c = self.compute[self.order]
        lo = np.searchsorted(sorted_c, self.compute[j] - units[1] * self.devices * b - slack, side="left")
        wide = np.maximum(hi - lo, 0)
        by_window = np.full(n, self.search != "column")
        if self.search == "column" or (self.search == "auto" and wide.sum() > 4 * len(cells)):
            pick, start, tall = self._columns(bound, first.index, last)  # wide windows (GNMT)
            if self.search == "auto":
                by_window = np.bincount(j, wide, n) <= np.bincount(self.js[pick], tall, n)
            take = ~by_window[self.js[pick]]
            self._fold_columns(best, bound, first.index, last, pick[take], start[take], tall[take])
        w = by_window[j]
        flat_first, i, j = first.table.reshape(-1), i[w], j[w]
        for owner, at in _runs(lo[w], wide[w]):
            k, ii, jj = self.order[at], i[owner], j[owner]
            _lower(best, bound, ii * n + jj, np.maximum(flat_first[ii * n + k], last[k * n + jj]))

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


class _Prior:
    """A finished table on fewer units, with the search structures ``_Splits.fold`` may need."""

    def __init__(self, table: FloatArray, order: IntArray) -> None:
        self.table = table
        self.order = order

    @functools.cached_property
    def index(self) -> _SortedTable:
        return _SortedTable.of(self.table)

    @functools.cached_property
    def reach(self) -> _Monotone:
        """Per row i and compute-order position p: the best entry at p or later (never decreasing)."""
        later = np.minimum.accumulate(self.table[:, self.order][:, ::-1], axis=1)[:, ::-1]
        return _Monotone.of(np.ascontiguousarray(later))


@dataclass(frozen=True)
class _Monotone:
    """Rows that never decrease, flattened with a row offset so one searchsorted counts per row.

    ``count(rows, b)`` is how many entries of each row are at most b, or a few more (the offset
    costs float precision, so the query is rounded up; extra entries are only extra work). Row r
    lives in [4·r·scale, 4·r·scale + 3·scale] (inf stored as 3·scale), queries are clipped to
    [-scale/2, 2·scale]: a query never reaches a neighbouring row.
    """

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
            c = count[a:b]
            owner = np.repeat(np.arange(a, b), c)
            yield owner, np.repeat(start[a:b] - (np.cumsum(c) - c), c) + np.arange(int(c.sum()))


@dataclass(frozen=True)
class _SortedTable:
    """The finite entries (i, k) of one table, sorted by k then by value, for joins on k.

    ``key`` = k · (entries + 1) + the value's rank (count of values <= it), so one searchsorted
    finds, for any k and threshold, how many entries of column k are at most the threshold.
    """

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
        starts = np.zeros(table.shape[1] + 1, dtype=np.int64)
        starts[1:] = np.cumsum(np.bincount(k, minlength=table.shape[1]))
        return _SortedTable(i[order], v[order], key[order], sorted_values, starts)

    def upto(self, k: IntArray, rank: IntArray) -> tuple[IntArray, IntArray]:
        """[start, stop) of the entries (., k) whose value has at most ``rank`` (``ranks``)."""
        stop = np.searchsorted(self.key, k * (len(self.values) + 1) + rank, side="right")
        return self.starts[k], stop

    def ranks(self, threshold: FloatArray) -> IntArray:
        """How many entries are at most each threshold: the rank ``upto`` compares with."""
        return np.asarray(np.searchsorted(self.sorted_values, threshold, side="right"), dtype=np.int64)


def _top_windows(prob: LevelProblem, ceiling: float, top: _Top | None) -> tuple[IntArray, IntArray]:
    """Top-level units any plan as fast as ``ceiling`` surely has before / after each state."""
    n = len(prob.states)
    if top is None or not (math.isfinite(ceiling) and ceiling > 0):
        return np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    w = prob.states.compute_s / (top.unit_devices * ceiling)
    before = np.maximum(np.ceil(w - 1e-9), 0.0).astype(np.int64)
    after = np.maximum(np.ceil(w[-1] - w - 1e-9), 0.0).astype(np.int64)
    return before, after


def _limits(
    ceiling: float, top: _Top | None, before: IntArray, after: int | IntArray, params: FloatArray
) -> FloatArray:
    """Slowest entry worth keeping per segment start i (the segment (i, j] has ``params``).

    A top stage from i has at most ``room`` replicas; on R of them it takes (T + sync_R) / R with
    sync_R = 4(R-1)P/(R·B·inner), so its inner time T must be at most R·ceiling - sync_R for some
    R <= room. The sync only grows with the parameters, so an open segment (i, j], which a top
    stage can only extend, is bounded by its own parameters too.
    """
    if top is None or not (math.isfinite(ceiling) and ceiling > 0):
        return np.full(len(before), ceiling * (1 + 1e-9))
    room = np.minimum(top.cap, top.units - before - after)
    reps = np.arange(1.0, max(int(room.max(initial=0)), 1) + 1.0)
    sync = 4.0 * (reps[None, :] - 1.0) * params[:, None] / (reps[None, :] * top.bandwidth * top.inner)
    value = np.where(reps[None, :] <= room[:, None], reps[None, :] * ceiling * (1 + 1e-9) - sync, -1.0)
    return np.asarray(value.max(axis=1), dtype=np.float64)


def _segment_grid(
    prob: LevelProblem, j: int, ks: IntArray, reps: FloatArray, charge_out: bool, charge_in: bool
) -> FloatArray:
    """[r, k]: time of stage (k, j] on reps[r] units; cut charges on the chosen sides only."""
    s = prob.states
    r = reps[:, None]
    dp = s.param_bytes[j] - s.param_bytes[ks]
    sync = 4.0 * (r - 1.0) * dp / (prob.bandwidth * r) / prob.inner
    t = (prob.base_time(j, ks) + sync) / r
    act = np.zeros(len(ks))
    if charge_in:
        act = np.where(ks > 0, s.act_bytes[ks], 0.0)
    if charge_out and j < len(s) - 1:
        act = np.maximum(act, s.act_bytes[j])
    return np.asarray(np.maximum(t, 2.0 * act / (prob.bandwidth * r)), dtype=np.float64)


def _unfold(tables: _Tables, m: int, i: int, j: int, is_open: bool) -> list[Segment]:
    """The inner stages of the best plan of segment (i, j] on up to m units (recomputed)."""
    prob, s = tables.prob, tables.prob.states
    target = tables.opened[m, i, j] if is_open else tables.closed[i, j]
    cap = prob.units if prob.max_replicas is None else min(prob.units, prob.max_replicas)
    ks = s.pred(j)
    ks = ks[np.array([s.masks[i] & ~s.masks[k] == 0 and k != i for k in ks], dtype=bool)]
    one = np.array([i], dtype=np.int64)
    for r in range(1, min(m, cap) + 1):
        rep = np.array([float(r)])
        if _segment_grid(prob, j, one, rep, is_open, False)[0, 0] == target:
            return [Segment(i, j, r)]
        if m - r >= 1 and len(ks):
            last = _segment_grid(prob, j, ks, rep, is_open, True)[0]
            hit = np.flatnonzero(np.maximum(tables.opened[m - r, i, ks], last) == target)
            if len(hit):
                k = int(ks[hit[0]])
                return [*_unfold(tables, m - r, i, k, True), Segment(k, j, r)]
    raise RuntimeError("segment table and its unfolding disagree (a pipeplan bug)")


def solve_hierarchy(
    states: StateSet, levels: list[tuple[int, float]], max_replicas: int | None = None
) -> tuple[float, list[Segment], float]:
    """PipeDream's recursion: each inner level's best segment time is the next level's compute time.

    A quick hierarchy over thinned prefixes of the layer order gives an attained time first; the
    inner tables then skip what no plan that fast could use (``_all_segments``' ceiling).
    """
    upper = math.inf
    thin = _prefix_subset(states)
    if thin is not None:
        upper = _solve_levels(thin, levels, max_replicas, math.inf)[0]
    return _solve_levels(states, levels, max_replicas, upper)


def _prefix_subset(states: StateSet, most: int = 48) -> StateSet | None:
    """The states that are prefixes of the layer order, thinned evenly by compute (None if few)."""
    idx = np.flatnonzero([m & (m + 1) == 0 for m in states.masks])
    if len(idx) < 2 or idx[-1] != len(states) - 1 or len(states) <= most:
        return None
    c = states.compute_s[idx]
    pick = np.searchsorted(c, np.linspace(0.0, c[-1], most))
    idx = idx[sorted({0, len(idx) - 1, *np.minimum(pick, len(idx) - 1).tolist()})]
    return StateSet(states.layer_ids, tuple(states.masks[i] for i in idx), states.compute_s[idx],
                    states.param_bytes[idx], states.saved_bytes[idx], states.act_bytes[idx], None,
                    False)  # fmt: skip


def _solve_levels(
    states: StateSet, levels: list[tuple[int, float]], max_replicas: int | None, upper: float
) -> tuple[float, list[Segment], float]:
    tables: list[_Tables] = []
    base: Callable[[int | IntArray, IntArray], FloatArray] | None = None
    inner, below = 1, 1
    caps = [d if max_replicas is None else min(d, max_replicas) for d, _ in levels]
    for level, (devices, bw) in enumerate(levels[:-1]):
        prob = LevelProblem(states, devices, bw, inner, base, max_replicas=max_replicas, unit_devices=below)
        last = level == len(levels) - 2
        above = _Top(levels[-1][0], caps[-1], below * devices, levels[-1][1], devices) if last else None
        table = _all_segments(prob, upper * math.prod(caps[level + 1 :]) if above is None else upper, above)
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


def _base_from(table: _Tables) -> Callable[[int | IntArray, IntArray], FloatArray]:
    best = table.closed

    def base(j: int | IntArray, ks: IntArray) -> FloatArray:
        return np.asarray(best[ks, j], dtype=np.float64)

    return base
