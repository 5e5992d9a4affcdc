"""Exact search for the synchronous schedules (1f1b, gpipe) on one level, by branch and bound: their
time sum(u) + (M-1)·max(u) + max(A) is not additive, so no single DP minimises it
(docs/optimizer-search.md)."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from partitioner.optimizer.pricing.memory import MemoryLimit
from partitioner.optimizer.pricing.stage import FloatArray, IntArray, allreduce_time, microbatch_time
from partitioner.optimizer.search.dp import Segment
from partitioner.optimizer.search.reach import fewest_units, fewest_units_after
from partitioner.optimizer.search.recomputing import Recomputing
from partitioner.optimizer.search.states import StateSet, csr_offsets
from partitioner.plan import Link

__all__ = ["MAX_CHOICES", "MAX_STEPS", "Placed", "placed_terms", "solve_synchronous"]

MAX_CHOICES = 2_000_000  # (stage, replicas) choices the DP prices per evaluation
MAX_STEPS = 400  # box splits and DP evaluations before returning the best plan and its bound
WIDE = 1.02  # a box whose tau range spans more than 2% may be probed at its geometric middle


Placed = tuple[FloatArray, FloatArray]
"""(held, later)[d - 1, r - 1]: the items a replica of a stage of r replicas holds d stages from the
end (``pricing.schedules.held_by_depth``), to the depth past which they no longer change."""


def placed_terms(held: FloatArray, later: FloatArray) -> Placed:
    """``held_by_depth``'s tables cut to the first depth from which they stay the same: a stage
    priced there is priced right at any depth a plan can have."""
    last = len(held)
    while last > 1 and (held[last - 2] == held[-1]).all() and (later[last - 2] == later[-1]).all():
        last -= 1
    return held[:last], later[:last]


def _memory_times(
    states: StateSet, k: IntArray, j: IntArray, u: FloatArray, memory: MemoryLimit, placed: Placed | None,
    redo: Recomputing | None, link: Link, m: int,
) -> tuple[FloatArray, FloatArray | None]:  # fmt: skip
    """Each stage's microbatch time under the limit: [pair, r - 1], and with ``placed`` [pair,
    depth - 1, r - 1] too (inf where it does not fit). ``redo``: a stage that does not fit keeping
    its activations recomputes where that fits (``all``: every stage recomputes), at its compute
    with the forward again, as ``price._priced`` decides."""
    n, r = len(states), np.arange(1, u.shape[1] + 1, dtype=np.float64)[None, :]
    out = np.where(j < n - 1, states.act_bytes[j], 0.0)
    copies, largest, working = memory.extras(states.masks, states.layer_ids, k, j, states.act_bytes[k], out)
    held = (states.param_bytes[j] - states.param_bytes[k] + copies)[:, None]
    keep = (held, states.item_bytes(k, j)[:, None], r, largest[:, None], working[:, None])
    ways = [] if redo is not None and redo.every else [(keep, u)]
    if redo is not None:
        again = states.compute(k, j) + redo.forward_s[j] - redo.forward_s[k]
        slower = microbatch_time(again[:, None], out[:, None], r, m, link)
        bytes_of = (held, redo.per_item(states, k, j)[:, None], r, largest[:, None],
                    (working + redo.once(states, k, j))[:, None])  # fmt: skip
        ways.append((bytes_of, slower))
    terms = [(None, None)] if placed is None else list(zip(*placed, strict=True))
    deep = np.full((len(k), len(terms), u.shape[1]), np.inf)
    for d, (items, later) in enumerate(terms):
        for bytes_of, time in reversed(ways):  # the first that fits wins: keeping, if it does
            if items is None:
                fits = memory.fits(*bytes_of)
            else:
                fits = memory.fits_held(*bytes_of[:3], items[None, :], later[None, :], *bytes_of[3:])
            deep[:, d] = np.where(fits, time, deep[:, d])
    return deep.min(axis=1), deep if placed is not None else None


@dataclass(frozen=True)
class _Choices:
    """Every stage (k, j], CSR by j, with its times on 1..cap replicas, and a quick test (rounded
    outwards: never rejects a feasible cap) whether any plan meets caps (tau, alpha)."""

    k: IntArray
    j: IntArray
    offsets: IntArray  # stages of state j are [offsets[j], offsets[j + 1])
    layers: IntArray  # ``StateSet.size_layers``
    x: FloatArray  # compute + 2·act_out/B: u = x / (r·M) up to rounding, what solving for r needs
    p: FloatArray  # parameter bytes: A = 4(r-1)p / (r·B)
    r_mem: FloatArray  # fewest replicas that fit the memory limit (inf: none)
    u: FloatArray  # [pair, r - 1] microbatch time (``stage.microbatch_time``)
    a: FloatArray  # [pair, r - 1] all-reduce: 4(r-1)P / (r·B)
    compute: FloatArray  # per state
    m: int
    cap: int
    link: Link
    deep: FloatArray | None = None  # [pair, depth - 1, r - 1] u at each depth (``_memory_times``)

    @staticmethod
    def of(
        states: StateSet, cap: int, link: Link, m: int, memory: MemoryLimit | None = None,
        placed: Placed | None = None, redo: Recomputing | None = None,
    ) -> _Choices:  # fmt: skip
        n = len(states)
        k, j = states.all_pairs()
        r = np.arange(1, cap + 1, dtype=np.float64)[None, :]
        out = np.where(j < n - 1, states.act_bytes[j], 0.0)
        compute = states.compute(k, j)
        x = compute + 2.0 * out / link.bandwidth  # (only to solve for replicas: u is about x / (r·M))
        params = states.param_bytes[j] - states.param_bytes[k]
        u = microbatch_time(compute[:, None], out[:, None], r, m, link)
        a = allreduce_time(params[:, None], r, link)
        r_mem, deep = np.ones(len(k)), None
        if memory is not None and placed is None and redo is None:  # all M microbatches held
            copies, largest, working = memory.extras(
                states.masks, states.layer_ids, k, j, states.act_bytes[k], out
            )
            saved = states.item_bytes(k, j)
            held = params + copies
            fits = memory.fits(held[:, None], saved[:, None], r, largest[:, None], working[:, None])
            u = np.where(fits, u, np.inf)
            r_mem = np.maximum(memory.replicas(held, saved, largest, working), 1.0)
        elif memory is not None:  # by depth, or two ways: the fewest replicas that fit, counted
            u, deep = _memory_times(states, k, j, u, memory, placed, redo, link, m)
            fits = np.isfinite(u)
            r_mem = np.where(fits.any(axis=1), np.argmax(fits, axis=1) + 1.0, np.inf)
        offsets = csr_offsets(j, n)
        u, a = np.asarray(u, dtype=np.float64), np.asarray(a, dtype=np.float64)
        layers = states.size_layers()
        return _Choices(k, j, offsets, layers, x, params, r_mem, u, a, states.compute_s, m, cap, link, deep)

    def need(self, tau: float, alpha: float) -> FloatArray:
        """Per stage, the fewest replicas that may meet the caps (rounded down; inf: none can)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            lo = np.maximum(np.ceil(self.x / (self.m * tau) * (1 - 1e-9)), self.r_mem)
            room = 1.0 - alpha * self.link.sync_bandwidth / (4.0 * self.p) * (
                1 + 1e-9
            )  # r <= 1 / room when room > 0
            hi = np.where(room > 0, np.floor(1.0 / room * (1 + 1e-9)), np.inf)
        return np.asarray(np.where(lo <= np.minimum(hi, self.cap), lo, np.inf), dtype=np.float64)

    def before(self, need: FloatArray, units: int) -> FloatArray:
        """Per state, the fewest devices a plan meeting the caps spends up to it (the last entry
        over ``units``: surely no plan meets them)."""
        return fewest_units(self.k, self.offsets, self.layers, need, units)


@dataclass(frozen=True)
class _Found:
    """A plan from one DP evaluation: its sum, maxima and stages."""

    total: float  # sum of u
    u_max: float
    a_max: float
    stages: list[Segment]


def _least_sum(
    ch: _Choices, n: int, units: int, tau: float, alpha: float, need: FloatArray, before: FloatArray
) -> _Found | None:  # fmt: skip
    """h(tau, alpha) and a plan attaining it (None when no plan meets the caps): f[j, g] = least sum
    of u covering state j on at most g devices, over the stages that fit the device windows."""
    c = ch.compute / (ch.m * tau) if tau > 0 else np.zeros_like(ch.compute)
    before = np.maximum(before, np.ceil(c * (1 - 1e-9)))
    after = fewest_units_after(ch.k, ch.j, ch.layers, need, units)
    after = np.maximum(after, np.ceil((c[-1] - c) * (1 - 1e-9)))
    rows = np.flatnonzero(before[ch.k] + need + after[ch.j] <= units)
    if not len(rows):
        return None
    u = np.where((ch.u[rows] <= tau) & (ch.a[rows] <= alpha), ch.u[rows], np.inf)
    finite = np.isfinite(u)
    live = finite.any(axis=1)  # (a stage no replica count lets meet the caps adds nothing)
    if not live.any():
        return None
    rows, u, finite = rows[live], u[live], finite[live]
    k, j = ch.k[rows], ch.j[rows]
    counts = np.flatnonzero(finite.any(axis=0))  # replica counts r - 1 that any stage may take
    low, cap = int(counts[0]), int(counts[-1]) + 1
    if ch.deep is not None:
        return _placed_sum(ch, n, units, rows, tau, alpha, low, cap)
    starts = np.flatnonzero(np.diff(j, prepend=-1))  # pairs are grouped by j
    ends = j[starts]
    f = np.full((n, units + 1), np.inf)
    f[0, :] = 0.0
    seen = np.full((len(k), units + 1), np.inf)  # seen[p, c] = f[k_p, c] once column c is done
    seen[k == 0, :] = 0.0
    for g in range(1, units + 1):
        f[:, g] = f[:, g - 1]
        reach = min(g, cap)
        if reach > low:  # r in (low, reach]: seen[:, g - r] + u[:, r - 1]
            val = (seen[:, g - 1 - low :: -1][:, : reach - low] + u[:, low:reach]).min(axis=1)
            f[ends, g] = np.minimum(f[ends, g], np.minimum.reduceat(val, starts))
        seen[:, g] = f[k, g]
    if not math.isfinite(f[n - 1, units]):
        return None
    stages = _trace(f, k, j, u, n - 1, units)
    us = [float(ch.u[rows[p], r - 1]) for p, r in stages]
    alls = [float(ch.a[rows[p], r - 1]) for p, r in stages]
    segments = [Segment(int(k[p]), int(j[p]), r) for p, r in stages]
    return _Found(math.fsum(us), max(us), max(alls), segments)


def _placed_sum(
    ch: _Choices, n: int, units: int, rows: IntArray, tau: float, alpha: float, low: int, cap: int
) -> _Found | None:
    """:func:`_least_sum` where a stage's time or fit depends on its depth, the stages from it to
    the end (``_Choices.deep``): f[j, e, g] = least sum of u covering state j on at most g devices
    with e stages still to come, e = depth standing for that many or more (priced alike). A stage
    (k, j] of depth e takes f[k, e] to f[j, e - 1]; from f[k, depth], to f[j, depth] too. Only the
    depths up to the last at which any stage's price changes are told apart."""
    assert ch.deep is not None
    k, j = ch.k[rows], ch.j[rows]
    caps = (ch.a[rows] <= alpha)[:, None, :cap]
    uu = np.where((ch.deep[rows][:, :, :cap] <= tau) & caps, ch.deep[rows][:, :, :cap], np.inf)
    changes = np.flatnonzero((uu[:, 1:] != uu[:, :-1]).any(axis=(0, 2)))
    depth = int(changes[-1]) + 2 if len(changes) else 1  # priced alike from there on
    uu = np.ascontiguousarray(uu[:, :depth].transpose(0, 2, 1))  # [pair, r - 1, depth - 1]
    starts = np.flatnonzero(np.diff(j, prepend=-1))  # pairs are grouped by j
    ends = j[starts]
    f = np.full((n, units + 1, depth + 1), np.inf)  # f[j, g, e]
    f[0, :, 1:] = 0.0  # any number of stages may follow the empty state
    # seen[p, units - c, e - 1] = f[k_p, c, e] once column c is done: the columns g - r, r = 1..,
    # in the order of r, are a run
    seen = np.full((len(k), units + 1, depth), np.inf)
    seen[k == 0] = 0.0
    for g in range(1, units + 1):
        f[:, g] = f[:, g - 1]
        reach = min(g, cap)
        # e <= units - g stages can follow a state reached on g devices (one device each at least):
        # a plan with more to come reached it on fewer devices, and is carried from there
        most = min(depth, units - g + 1)
        if reach > low:
            at = units - g + 1
            val = (seen[:, at + low : at + reach, :most] + uu[:, low:reach, :most]).min(axis=1)
            best = np.minimum.reduceat(val, starts, axis=0)  # [end, e - 1]: stage depth e, e - 1 to come
            f[ends, g, :most] = np.minimum(f[ends, g, :most], best)
            if most == depth:  # more still to come
                f[ends, g, depth] = np.minimum(f[ends, g, depth], best[:, depth - 1])
        seen[:, units - g] = f[k, g, 1:]
    if not math.isfinite(f[n - 1, units, 0]):
        return None
    stages = _placed_trace(f, k, j, uu, n - 1, units)
    us = [float(uu[p, r - 1, e - 1]) for p, e, r in stages]
    alls = [float(ch.a[rows[p], r - 1]) for p, _, r in stages]
    segments = [Segment(int(k[p]), int(j[p]), r) for p, _, r in stages]
    return _Found(math.fsum(us), max(us), max(alls), segments)


def _placed_trace(
    f: FloatArray, k: IntArray, j: IntArray, uu: FloatArray, end: int, g: int
) -> list[tuple[int, int, int]]:
    """:func:`_trace` of :func:`_placed_sum`'s table f[j, g, e] (``uu``: [pair, r - 1, e - 1]),
    from the last state with no stage to come: (pair, depth, replicas) of each stage, first first."""
    depth, e, chosen = uu.shape[2], 0, []
    while end > 0:
        while g > 1 and f[end, g - 1, e] <= f[end, g, e]:
            g -= 1  # the value was reached on fewer devices
        before = min(e + 1, depth)  # the stage's depth: e + 1, or "depth or more"
        mine = np.flatnonzero(j == end)
        reach = min(g, uu.shape[1])
        val = f[k[mine], g - 1 :: -1, before][:, :reach] + uu[mine, :reach, before - 1]
        hit = np.argwhere(val <= f[end, g, e])
        if not len(hit):
            raise RuntimeError("synchronous DP and its trace disagree (a pipeplan bug)")
        p, r = int(mine[hit[0, 0]]), int(hit[0, 1]) + 1
        chosen.append((p, before, r))
        end, g, e = int(k[p]), g - r, before
    return chosen[::-1]


def _trace(f: FloatArray, k: IntArray, j: IntArray, u: FloatArray, end: int, g: int) -> list[tuple[int, int]]:
    """The (pair, replicas) behind f[end, g], first stage first: at each state the first that attains it."""
    chosen: list[tuple[int, int]] = []
    while end > 0:
        while g > 1 and f[end, g - 1] <= f[end, g]:
            g -= 1  # the value was reached on fewer devices
        mine = np.flatnonzero(j == end)
        reach = min(g, u.shape[1])
        val = f[k[mine]][:, g - 1 :: -1][:, :reach] + u[mine, :reach]
        hit = np.argwhere(val <= f[end, g])
        if not len(hit):
            raise RuntimeError("synchronous DP and its trace disagree (a pipeplan bug)")
        p, r = int(mine[hit[0, 0]]), int(hit[0, 1]) + 1
        chosen.append((p, r))
        end, g = int(k[p]), g - r
    return chosen[::-1]


@dataclass(order=True)
class _Box:
    """Plans whose max u lies in [tau_lo, tau_hi] and max A in [alpha_lo, alpha_hi], all of whose
    sums are at least ``floor``: none costs less than ``bound``."""

    bound: float
    tau_lo: float
    tau_hi: float
    alpha_lo: float
    alpha_hi: float
    floor: float


Solved = tuple[float, list[Segment], float] | None

_UNLIMITED: dict[tuple[object, ...], Solved] = {}
"""The last searches without a memory limit, by what they read: ``--schedule auto`` asks the same
one of 1f1b, gpipe and zb1p at each microbatch count (their states differ in saved bytes only,
which no limit reads), and the unlimited search is most of a memory-bound problem's time."""


def _unlimited_key(
    states: StateSet, units: int, link: Link, m: int, cap: int, steps: int
) -> tuple[object, ...]:
    """Everything a search without a memory limit reads of its states (the downsets, whose strict
    subsets are the pairs, and their compute, parameter and cut sums) and of its arguments."""
    sums = (states.compute_s, states.param_bytes, states.act_bytes)
    shape = (states.layer_ids, states.masks, type(states.preds).__name__, states.pair_count(), states.exact)
    data = tuple(np.asarray(a, dtype=np.float64).tobytes() for a in sums)
    return (*shape, states.stage_s, *data, units, link, m, cap, steps)


def solve_synchronous(
    states: StateSet, units: int, link: Link, m: int, cap: int, steps: int = MAX_STEPS,
    memory: MemoryLimit | None = None, placed: Placed | None = None, redo: Recomputing | None = None,
) -> Solved:  # fmt: skip
    """The plan minimising the synchronous time per minibatch over the states, by branch and bound.

    Returns (time, stages, certified lower bound: equal to the time when the search finished
    within ``steps`` box splits and evaluations), or None when the problem has more than
    ``MAX_CHOICES`` choices or no plan fits the devices. ``placed``: with ``memory``, the items a
    replica holds by its stage's depth (:func:`placed_terms`), else all of its microbatches;
    ``redo``: with ``memory``, a stage may recompute its forward to fit (the plan's stages then
    recompute as ``price`` decides with ``recompute="auto"``, or ``"all"``). Without
    ``memory``, remembered for the last few problems (:data:`_UNLIMITED`: the same inputs, the same
    answer).
    """
    if states.pair_count() * cap > MAX_CHOICES:
        return None
    if memory is not None:
        return _branch_and_bound(states, units, link, m, cap, steps, memory, placed, redo)
    key = _unlimited_key(states, units, link, m, cap, steps)
    if key not in _UNLIMITED:
        _UNLIMITED[key] = _branch_and_bound(states, units, link, m, cap, steps, None)
        while len(_UNLIMITED) > 32:
            del _UNLIMITED[next(iter(_UNLIMITED))]
    found = _UNLIMITED[key]
    return None if found is None else (found[0], list(found[1]), found[2])


def _branch_and_bound(
    states: StateSet, units: int, link: Link, m: int, cap: int, steps: int, memory: MemoryLimit | None,
    placed: Placed | None = None, redo: Recomputing | None = None,
) -> Solved:  # fmt: skip
    """:func:`solve_synchronous`'s search."""
    ch = _Choices.of(states, cap, link, m, memory, placed, redo)
    n = len(states)
    if not np.isfinite(ch.u).any():
        return None  # no stage fits the memory limit on any replica count
    every = ch.u if ch.deep is None else ch.deep  # (a stage may be slower at another depth)
    tau_hi = float(every[np.isfinite(every)].max())
    tau_lo = _least_bottleneck(ch, units, tau_hi)
    a_hi = float(ch.a.max(initial=0.0))
    need = ch.need(tau_hi, a_hi)
    top = _least_sum(ch, n, units, tau_hi, a_hi, need, ch.before(need, units))  # the least sum of all
    if top is None:
        return None
    best = (top.total + (m - 1) * top.u_max + top.a_max, top.stages)
    heap = [_Box(top.total + (m - 1) * tau_lo, tau_lo, tau_hi, 0.0, a_hi, top.total)]
    for _ in range(steps):
        if not heap or heap[0].bound >= best[0] * (1 - 1e-12):
            return best[0], best[1], best[0]
        box = heapq.heappop(heap)
        tau, alpha, upper = _probe(box, m, best[0])
        if upper is not None:  # plans above the probe are not feasible there: no better floor
            heapq.heappush(heap, upper)
        need = ch.need(tau, alpha)
        before = ch.before(need, units)
        if not before[-1] <= units:
            continue  # nothing at or below the probe
        found = _least_sum(ch, n, units, tau, alpha, need, before)
        if found is None:
            continue
        t = found.total + (m - 1) * found.u_max + found.a_max
        if t < best[0]:
            best = (t, found.stages)
        for t_lo, t_hi, a_lo, a_hi in _uncovered(box, tau, alpha, found):
            bound = found.total + (m - 1) * t_lo + a_lo
            heapq.heappush(heap, _Box(bound, t_lo, t_hi, a_lo, a_hi, found.total))
    return best[0], best[1], min(best[0], heap[0].bound if heap else best[0])


def _least_bottleneck(ch: _Choices, units: int, hi: float) -> float:
    """A lower bound on every plan's max u, within 1e-6 of the least (bisection on ``before``)."""
    lo = 0.0
    while hi - lo > 1e-6 * hi:
        mid = 0.5 * (lo + hi)
        if ch.before(ch.need(mid, math.inf), units)[-1] <= units:
            hi = mid
        else:
            lo = mid
    return max(lo, 1e-12 * hi)


def _probe(box: _Box, m: int, best: float) -> tuple[float, float, _Box | None]:
    """Where to evaluate a box: its upper corner, or the middle of whichever range would raise the
    bound of the part above it more (tau geometrically, alpha arithmetically), as in a bisection;
    that part above is returned as its own box."""
    gain_tau = (m - 1) * (math.sqrt(box.tau_lo * box.tau_hi) - box.tau_lo)
    gain_alpha = 0.5 * (box.alpha_hi - box.alpha_lo)
    if box.tau_hi > box.tau_lo * WIDE and m > 1 and gain_tau >= gain_alpha:
        mid = math.sqrt(box.tau_lo * box.tau_hi)
        bound = box.floor + (m - 1) * mid + box.alpha_lo
        return mid, box.alpha_hi, _Box(bound, mid, box.tau_hi, box.alpha_lo, box.alpha_hi, box.floor)
    if gain_alpha > 0.01 * best:
        mid = box.alpha_lo + gain_alpha
        bound = box.floor + (m - 1) * box.tau_lo + mid
        return box.tau_hi, mid, _Box(bound, box.tau_lo, box.tau_hi, mid, box.alpha_hi, box.floor)
    return box.tau_hi, box.alpha_hi, None


def _uncovered(box: _Box, tau: float, alpha: float, found: _Found) -> list[tuple[float, float, float, float]]:
    """[tau_lo, tau] x [alpha_lo, alpha] minus [u_max, tau] x [a_max, alpha], which the plan found
    at (tau, alpha) settles (every plan in it is feasible there, so sums at least as much)."""
    rest = []
    if found.u_max > box.tau_lo:  # smaller max u
        rest.append((box.tau_lo, found.u_max * (1 - 1e-12), box.alpha_lo, alpha))
    if found.a_max > box.alpha_lo:  # the same u range, smaller max A
        rest.append((max(found.u_max, box.tau_lo), tau, box.alpha_lo, found.a_max * (1 - 1e-12)))
    return rest
