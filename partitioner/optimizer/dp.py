"""Exact stage + replication DP over downset states, vectorised with numpy, level by level.

The final level minimises the slowest stage (PipeDream's objective) by bisection on that time:
for a candidate time t, ``_min_units`` computes the fewest devices that cover each downset with stages
no slower than t (the replicas a stage needs at time t have a closed form, so each state is one numpy
pass over its predecessor states). Each feasible t is tightened to the plan's real time, so the search
ends on an attained value with a certified lower bound (the largest infeasible t). Inner levels of a
hierarchy (servers made of GPUs) need the best time of *every* segment on one unit, as PipeDream's
recursion does; ``_all_segments`` fills that table directly, vectorised over segment starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
    """

    states: StateSet
    units: int
    bandwidth: float
    inner: int = 1
    base: Callable[[int, IntArray], FloatArray] | None = None
    min_replicas: int = 1
    max_replicas: int | None = None
    memory: tuple[float, int, str, int] | None = field(default=None)

    def base_time(self, j: int, ks: IntArray) -> FloatArray:
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
        base = np.concatenate([prob.base_time(j, k) for j, k in enumerate(ks_list)]) if len(ks) else ks * 0.0
        params = s.param_bytes[js] - s.param_bytes[ks]
        act = np.where(ks > 0, s.act_bytes[ks], 0.0)
        act = np.maximum(act, np.where(js < n - 1, s.act_bytes[js], 0.0))
        q = 4.0 * params / (prob.bandwidth * prob.inner)
        return _Pairs(offsets, ks, np.asarray(base, dtype=np.float64), q, act, params,
                      s.saved_bytes[js] - s.saved_bytes[ks])  # fmt: skip

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


def solve_direct(prob: LevelProblem, pairs: _Pairs | None = None) -> tuple[float, list[Segment]]:
    """PipeDream's recurrence, exactly: f[j, u] = min over (k, r) of max(f[k, u - r], T(k, j, r)).

    One pass over the pairs, vectorised over predecessors and device counts (``f[k, u]`` is the
    best time of state k on at most u units). Costs pairs x units^2 / 2, so for few units it beats
    the bisection; it has no memory model (the bisection has).
    """
    pairs = pairs or _Pairs.of(prob)
    n, units = len(prob.states), prob.units
    cap = units if prob.max_replicas is None else min(units, prob.max_replicas)
    f = np.full((n, units + 1), np.inf)
    f[0, :] = 0.0
    arg_k = np.zeros((n, units + 1), dtype=np.int64)
    arg_r = np.zeros((n, units + 1), dtype=np.int64)
    reps = np.arange(max(1, prob.min_replicas), cap + 1, dtype=np.float64)
    shift = np.arange(units + 1)[None, :] - reps[:, None].astype(np.int64)  # [r, u] -> u - r
    valid = shift >= 0
    shift = np.where(valid, shift, 0)
    for j in range(1, n):
        lo, hi = int(pairs.offsets[j]), int(pairs.offsets[j + 1])
        ks = pairs.ks[lo:hi]
        busy = (pairs.base[lo:hi, None] + pairs.q[lo:hi, None] * (reps - 1.0) / reps) / reps
        t = np.maximum(busy, 2.0 * pairs.act[lo:hi, None] / (prob.bandwidth * reps))  # [k, r]
        if len(ks) * len(reps) * (units + 1) <= BLOCK_ELEMENTS:  # one shot over (k, r, u)
            prev = np.where(valid, f[ks][:, shift], np.inf)  # [k, r, u]: f[k, u - r]
            cand = np.maximum(prev, t[:, :, None]).reshape(len(ks) * len(reps), units + 1)
            at = np.argmin(cand, axis=0)
            f[j] = cand[at, np.arange(units + 1)]
            arg_k[j] = ks[at // len(reps)]
            arg_r[j] = reps[at % len(reps)].astype(np.int64)
            continue
        rows = f[ks]
        for i, r in enumerate(int(x) for x in reps):  # large predecessor sets: one r at a time
            cand2 = np.maximum(rows[:, : units + 1 - r], t[:, i, None])  # column c: u = c + r
            at2 = np.argmin(cand2, axis=0)
            val = cand2[at2, np.arange(units + 1 - r)]
            better = val < f[j, r:]
            f[j, r:][better] = val[better]
            arg_k[j, r:][better] = ks[at2[better]]
            arg_r[j, r:][better] = r
    last = n - 1
    if not np.isfinite(f[last, units]):
        raise InfeasibleError("no plan fits")
    stages: list[Segment] = []
    j, u = last, units
    while j > 0:
        k, used = int(arg_k[j, u]), int(arg_r[j, u])
        stages.append(Segment(k, j, used))
        j, u = k, u - used
    return float(f[last, units]), stages[::-1]


def solve_bottleneck(prob: LevelProblem, lower: float = 0.0) -> tuple[float, list[Segment], float]:
    """Minimise the slowest stage at this level; returns (time, stages, certified lower bound).

    Few units and no memory limit: the direct recurrence (exact, bound = the optimum). Otherwise
    bisection on the time with the fewest-units DP.

    Raises:
        InfeasibleError: no plan fits, even with unlimited time (memory too small).
    """
    pairs = _Pairs.of(prob)
    if prob.memory is None and prob.units <= DIRECT_MAX_UNITS:
        time, stages = solve_direct(prob, pairs)
        return time, stages, time
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
class _Table:
    """Best time of every segment (i, j] on up to m units, plus how it splits."""

    time: FloatArray  # [m, i, j]
    split: IntArray  # [m, i, j]: previous cut k, or -1 for one stage
    reps: IntArray  # [m, i, j]: replicas of the segment's last stage

    @staticmethod
    def empty(units: int, n: int) -> _Table:
        return _Table(
            np.full((units + 1, n, n), np.inf),
            np.full((units + 1, n, n), -1, dtype=np.int64),
            np.zeros((units + 1, n, n), dtype=np.int64),
        )

    def offer_single(self, m: int, ks: IntArray, j: int, cand: FloatArray, r: int) -> None:
        better = cand < self.time[m, ks, j]
        rows = ks[better]
        self.time[m, rows, j] = cand[better]
        self.split[m, rows, j] = -1
        self.reps[m, rows, j] = r

    def offer_split(self, m: int, j: int, cand: FloatArray, ks: IntArray, r: int) -> None:
        at = np.argmin(cand, axis=1)
        best = cand[np.arange(cand.shape[0]), at]
        better = best < self.time[m, :, j]
        self.time[m, better, j] = best[better]
        self.split[m, better, j] = ks[at[better]]
        self.reps[m, better, j] = r


def _all_segments(prob: LevelProblem) -> tuple[_Table, _Table]:
    """Direct DP over all segment starts at once (PipeDream's non-final level).

    Returns two tables: ``closed`` (the segment's last stage does not pay for its output, which
    the next level charges) and ``opened`` (it does: the segment ends at an internal cut).
    """
    s, n, units = prob.states, len(prob.states), prob.units
    cap = units if prob.max_replicas is None else min(units, prob.max_replicas)
    closed, opened = _Table.empty(units, n), _Table.empty(units, n)
    sub = s.subset_matrix()
    for j in range(1, n):
        ks = s.pred(j)
        for m in range(1, units + 1):
            for r in range(1, min(m, cap) + 1):
                closed.offer_single(m, ks, j, _segment_times(prob, j, ks, r, False, False), r)
                opened.offer_single(m, ks, j, _segment_times(prob, j, ks, r, True, False), r)
                if m - r < 1:
                    continue
                prev = np.where(sub[:, ks], opened.time[m - r][:, ks], np.inf)  # [i, k]
                last_c = _segment_times(prob, j, ks, r, False, True)
                last_o = _segment_times(prob, j, ks, r, True, True)
                closed.offer_split(m, j, np.maximum(prev, last_c[None, :]), ks, r)
                opened.offer_split(m, j, np.maximum(prev, last_o[None, :]), ks, r)
    return closed, opened


def _segment_times(
    prob: LevelProblem, j: int, ks: IntArray, r: int, charge_out: bool, charge_in: bool
) -> FloatArray:
    s = prob.states
    dp = s.param_bytes[j] - s.param_bytes[ks]
    sync = 4.0 * (r - 1) * dp / (prob.bandwidth * r) / prob.inner
    t = (prob.base_time(j, ks) + sync) / r
    act = np.zeros(len(ks))
    if charge_in:
        act = np.where(ks > 0, s.act_bytes[ks], 0.0)
    if charge_out and j < len(s) - 1:
        act = np.maximum(act, s.act_bytes[j])
    return np.asarray(np.maximum(t, 2.0 * act / (prob.bandwidth * r)), dtype=np.float64)


def _unfold(tables: tuple[_Table, _Table], m: int, i: int, j: int, is_open: bool) -> list[Segment]:
    """The inner stages of the best plan of segment (i, j] on up to m units."""
    table = tables[1] if is_open else tables[0]
    k = int(table.split[m, i, j])
    r = int(table.reps[m, i, j])
    if k < 0:
        return [Segment(i, j, r)]
    return [*_unfold(tables, m - r, i, k, True), Segment(k, j, r)]


def solve_hierarchy(
    states: StateSet, levels: list[tuple[int, float]], max_replicas: int | None = None
) -> tuple[float, list[Segment], float]:
    """PipeDream's recursion: each inner level's best segment time is the next level's compute time."""
    tables: list[tuple[_Table, _Table]] = []
    base: Callable[[int, IntArray], FloatArray] | None = None
    inner = 1
    for devices, bw in levels[:-1]:
        prob = LevelProblem(states, devices, bw, inner, base, max_replicas=max_replicas)
        pair = _all_segments(prob)
        tables.append(pair)
        base = _base_from(pair[0], devices)
        inner = devices
    devices, bw = levels[-1]
    lower = float(states.compute_s[-1]) / math.prod(d for d, _ in levels)
    top = LevelProblem(states, devices, bw, inner, base, max_replicas=max_replicas)
    time, stages, lo = solve_bottleneck(top, lower)

    def expand(seg: Segment, level: int) -> Segment:
        if level < 0:
            return seg
        subs = _unfold(tables[level], levels[level][0], seg.start, seg.end, False)
        return Segment(seg.start, seg.end, seg.replicas, tuple(expand(x, level - 1) for x in subs))

    return time, [expand(seg, len(tables) - 1) for seg in stages], lo


def _base_from(table: _Table, units: int) -> Callable[[int, IntArray], FloatArray]:
    best = table.time[units]

    def base(j: int, ks: IntArray) -> FloatArray:
        return np.asarray(best[ks, j], dtype=np.float64)

    return base
