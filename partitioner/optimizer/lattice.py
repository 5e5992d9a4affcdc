"""Exact search over *all* downsets without enumerating stage pairs, for DAGs with many downsets.

The pair DP needs every (earlier cut, later cut) pair: billions on Inception-v3. Here, for a candidate
time t and r replicas, stage (k, j] fits iff W_r(k) >= W_r(j) - r·t with W_r = compute + 4(r-1)/(rB)
params (linear in the additive sums) and k's cut traffic fits r. So the question "fewest devices for
cut j" only needs, for every device count v, the largest W_r over the cuts below j that v devices
reach; that maximum propagates through the downset lattice along its covering edges (j minus one
maximal layer), one size layer at a time. A probe costs states x covers x replicas x devices, and a
bisection over t finds the optimum to a relative 1e-7.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from partitioner.errors import InfeasibleError
from partitioner.graph import Profile
from partitioner.optimizer.dp import Segment
from partitioner.optimizer.states import _layers
from partitioner.optimizer.states import addable as _addable

__all__ = ["Lattice", "enumerate_lattice", "solve_lattice"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
SLACK = 1e-6  # float32 probes: thresholds are trusted to this relative precision


@dataclass(frozen=True)
class Lattice:
    """All downsets, grouped by size, with their lower covers (the downset minus one maximal layer).

    Attributes:
        layer_ids: the layers, topologically ordered (bit i of a mask = layer_ids[i]).
        masks: every downset, ordered by size; index 0 is empty, the last is everything.
        starts: states of size s are ``starts[s]:starts[s + 1]``.
        covers: [state, c] global index of a lower cover, -1 padding.
        compute_s, param_bytes, act_bytes: additive sums and the bytes leaving each downset.
    """

    layer_ids: tuple[str, ...]
    masks: tuple[int, ...]
    starts: IntArray
    covers: IntArray
    compute_s: FloatArray
    param_bytes: FloatArray
    act_bytes: FloatArray

    def members(self, k: int, j: int) -> tuple[str, ...]:
        """Layer ids in downset j but not in downset k, in topological order."""
        diff = self.masks[j] & ~self.masks[k]
        return tuple(lid for i, lid in enumerate(self.layer_ids) if diff >> i & 1)


def enumerate_lattice(profile: Profile, cap: int, max_layer: int = 20_000) -> Lattice | None:
    """Every downset, size layer by size layer, with covers and sums.

    None beyond ``cap`` downsets, or as soon as one size layer exceeds ``max_layer`` (a cheap sign
    that the total explodes, as on NASNet; Inception-v3's widest layer has 7,010).
    """
    ids, preds, succs = _layers(profile)
    nodes = {n.id: n for n in profile.nodes}
    comp = [nodes[i].compute_ms / 1000.0 for i in ids]
    par = [float(nodes[i].param_bytes) for i in ids]
    out = [float(nodes[i].output_bytes) for i in ids]
    addable0 = sum(1 << i for i, p in enumerate(preds) if p == 0)
    masks, c_s, p_s, a_s, starts = [0], [0.0], [0.0], [0.0], [0, 1]
    covers: list[list[int]] = [[]]
    layer: dict[int, int] = {0: 0}
    addable = {0: addable0}
    while layer:
        nxt: dict[int, int] = {}
        nxt_addable: dict[int, int] = {}
        for mask, idx in layer.items():
            free = addable[mask]
            while free:
                low = free & -free
                free ^= low
                x = low.bit_length() - 1
                grown = mask | low
                at = nxt.get(grown)
                if at is None:
                    at = len(masks)
                    nxt[grown] = at
                    masks.append(grown)
                    covers.append([])
                    c_s.append(c_s[idx] + comp[x])
                    p_s.append(p_s[idx] + par[x])
                    a_s.append(a_s[idx] + _act_delta(x, grown, preds, succs, out))
                    nxt_addable[grown] = _addable(addable[mask] & ~low, x, grown, preds, succs)
                    if len(masks) > cap:
                        return None
                covers[at].append(idx)
        if len(nxt) > max_layer:
            return None
        if nxt:
            starts.append(len(masks))
        layer, addable = nxt, nxt_addable
    width = max(len(c) for c in covers)
    cov = np.full((len(masks), max(width, 1)), -1, dtype=np.int64)
    for i, c in enumerate(covers):
        cov[i, : len(c)] = c
    return Lattice(tuple(ids), tuple(masks), np.array(starts, dtype=np.int64), cov,
                   np.array(c_s), np.array(p_s), np.array(a_s))  # fmt: skip


def _act_delta(x: int, grown: int, preds: list[int], succs: list[int], out: list[float]) -> float:
    """Change of the bytes leaving the downset when maximal layer x joins it."""
    delta = out[x] if succs[x] else 0.0
    p = preds[x]
    while p:
        low = p & -p
        p ^= low
        y = low.bit_length() - 1
        if succs[y] & grown == succs[y]:  # y's last reader arrived: its output no longer leaves
            delta -= out[y]
    return delta


def _weights(lat: Lattice, reps: FloatArray, bandwidth: float) -> FloatArray:
    """W[r, state] = compute + 4(r-1)/(rB) params: a stage fits r replicas at t iff dW <= r·t."""
    a = 4.0 * (reps - 1.0) / (reps * bandwidth)
    return np.asarray(lat.compute_s[None, :] + a[:, None] * lat.param_bytes[None, :], dtype=np.float64)


def _probe(lat: Lattice, units: int, bandwidth: float, tau: float, weights: FloatArray) -> FloatArray:
    """g[state]: fewest devices covering each downset with every stage at most tau (inf if none).

    ``best[j, r, v]`` is the largest W_r of a cut strictly below j that v devices reach and whose
    traffic r replicas can receive; it is the max over j's lower covers of theirs (state-major
    float32 arrays, so the gathers copy whole rows).
    """
    reps = np.arange(1, weights.shape[0] + 1, dtype=np.float64)
    v_axis = np.arange(units, dtype=np.float64)  # devices before a stage: 0 .. units-1
    room = bandwidth * tau * reps / 2.0  # cut bytes r replicas can move within tau
    n, last = len(lat.masks), len(lat.masks) - 1
    g = np.full(n, np.inf)
    g[0] = 0.0
    wt = weights.T.astype(np.float32)  # [state, r]
    prev = np.empty((1, len(reps), units), dtype=np.float32)  # the layer of the empty cut
    prev[0] = wt[0][:, None]
    for s in range(1, len(lat.starts) - 1):
        lo, hi = int(lat.starts[s]), int(lat.starts[s + 1])
        plo = int(lat.starts[s - 1])
        cov = lat.covers[lo:hi]
        best = prev[cov[:, 0] - plo]  # [j, r, v]; every non-empty downset has a lower cover
        for c in range(1, cov.shape[1]):
            rows = np.flatnonzero(cov[:, c] >= 0)
            if not len(rows):
                break
            best[rows] = np.maximum(best[rows], prev[cov[rows, c] - plo])
        need = (weights[:, lo:hi] - reps[:, None] * tau * (1 + 1e-12)).T.astype(np.float32)  # [j, r]
        short = (best < need[:, :, None]).sum(axis=2)  # best rises with v: count of v short of need
        vmin = np.where(short < units, short, np.inf)
        fits = lat.act_bytes[lo:hi, None] <= room[None, :] * (1 + 1e-12)
        if hi - 1 == last:
            fits[-1] = True
        g[lo:hi] = np.where(fits, vmin + reps[None, :], np.inf).min(axis=1)
        mask = (v_axis[None, None, :] >= g[lo:hi, None, None]) & fits[:, :, None]
        np.maximum(best, wt[lo:hi][:, :, None], out=best, where=mask)
        prev = best
    return g


def _stage_times(lat: Lattice, ks: IntArray, j: int, r: int, bandwidth: float) -> FloatArray:
    dc = lat.compute_s[j] - lat.compute_s[ks]
    dp = lat.param_bytes[j] - lat.param_bytes[ks]
    busy = (dc + 4.0 * (r - 1) * dp / (r * bandwidth)) / r
    act = np.where(ks > 0, lat.act_bytes[ks], 0.0)
    if j < len(lat.masks) - 1:
        act = np.maximum(act, lat.act_bytes[j])
    return np.asarray(np.maximum(busy, 2.0 * act / (bandwidth * r)), dtype=np.float64)


def _packed(lat: Lattice) -> npt.NDArray[np.uint64]:
    """The masks as rows of 64-bit words, for vectorised subset tests."""
    words = max(1, (len(lat.layer_ids) + 63) // 64)
    low = (1 << 64) - 1
    columns = [np.array([(m >> (64 * w)) & low for m in lat.masks], dtype=np.uint64) for w in range(words)]
    return np.stack(columns, axis=1)


def _walk(
    lat: Lattice,
    packed: npt.NDArray[np.uint64],
    g: FloatArray,
    units: int,
    bandwidth: float,
    tau: float,
    cap: int,
) -> list[Segment]:
    """Rebuild a plan meeting tau from g: for each stage find a fitting predecessor explicitly."""
    stages: list[Segment] = []
    j, budget = len(lat.masks) - 1, units
    while j > 0:
        below = np.flatnonzero(((packed[:j] & ~packed[j]) == 0).all(axis=1))  # strict subsets of j
        found = None
        for r in range(1, min(cap, budget) + 1):
            ks = below[g[below] <= budget - r]
            if len(ks) == 0:
                continue
            fit = np.flatnonzero(_stage_times(lat, ks, j, r, bandwidth) <= tau * (1 + SLACK))
            if len(fit):
                found = (int(ks[fit[0]]), r)
                break
        if found is None:
            raise RuntimeError("lattice probe and reconstruction disagree (a pipeplan bug)")
        k, r = found
        stages.append(Segment(k, j, r))
        j, budget = k, budget - r
    return stages[::-1]


def solve_lattice(
    lat: Lattice, units: int, bandwidth: float, lower: float, upper: float, max_replicas: int | None = None
) -> tuple[float, list[Segment], float]:
    """Optimum over all downsets, between a lower bound and an attained time ``upper``.

    Bisection to 1e-3, then descent on attained values: rebuild the plan, and probe just below its
    exact time; when that fails the plan is optimal (to the float32 probe's 1e-6 slack).

    Returns:
        (time, stages, certified lower bound).
    """
    cap = units if max_replicas is None else min(units, max_replicas)
    weights = _weights(lat, np.arange(1, cap + 1, dtype=np.float64), bandwidth)
    packed = _packed(lat)

    def attained(tau: float) -> tuple[float, list[Segment]] | None:
        """The plan a feasible probe at tau rebuilds, with its exact time; None when infeasible."""
        g = _probe(lat, units, bandwidth, tau, weights)
        if not g[-1] <= units:
            return None
        stages = _walk(lat, packed, g, units, bandwidth, tau, cap)
        ends = [
            float(_stage_times(lat, np.array([s.start]), s.end, s.replicas, bandwidth)[0]) for s in stages
        ]
        return max(ends), stages

    found = attained(upper)
    if found is None:
        raise InfeasibleError("no plan fits")
    hi, stages = found
    lo, step = lower, 0.03
    while lo < hi * (1 - step):  # gallop down from the upper plan: the optimum is usually close
        found = attained(hi * (1 - step))
        if found is None:
            lo = hi * (1 - step)
            break
        hi, stages = found
        step *= 2
    while True:
        mid = 0.5 * (lo + hi) if hi - lo > 3e-3 * hi else hi * (1 - 10 * SLACK)  # then descent
        found = attained(mid)
        if found is None:
            lo = mid
            if mid >= hi * (1 - 10 * SLACK) * (1 - SLACK):  # nothing strictly faster than hi
                return hi, stages, max(lower, mid * (1 - SLACK))
        elif found[0] <= hi:
            hi, stages = found
