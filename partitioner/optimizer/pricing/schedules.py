"""Cost and memory models of one pipeline plan, per schedule.

``pipedream`` is PipeDream's published optimizer objective (optimizer_graph_hierarchical.py): a stage of
compute C and parameters P on r replicas over bandwidth B takes (C + 4(r-1)P/(rB)/inner)/r, where
``inner`` is the number of devices in one unit of the level (1 on the innermost level); every cut
costs 2·activation/(B·r) on each side of it, with that side's r; the pipeline's time per minibatch is
the slowest of all these terms. ``1f1b`` and ``gpipe`` are synchronous: M microbatches flow through,
so a minibatch takes the sum of one microbatch's stage times, plus (M-1) slowest stages, plus the
largest gradient all-reduce once per minibatch. ``zb1p`` (zero bubble H1) splits each backward into
B (input gradients, on the critical path) and W (weight gradients, deferred into the bubbles); see
:func:`zero_bubble_time` for its closed form and :data:`W_SHARE` for the split.

Activation recomputation (``price_stage(..., recompute=True)``): a stage that recomputes keeps only
its inputs per item in flight and runs its forward again in backward, so its compute grows by its
forward time; while one item's backward runs, that item's activations exist again, so one item's
saved activations stay in its peak.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from partitioner.errors import PlanError
from partitioner.optimizer.pricing.memory import OPTIMIZER_STATE, peak_bytes, transient_bytes
from partitioner.optimizer.search.states import FloatArray
from runtime.schedule import interleaved_rank

__all__ = [
    "OPTIMIZER_STATE",
    "RECOMPUTE_MODES",
    "W_SHARE",
    "StageLoad",
    "StagePrice",
    "StageTimes",
    "activation_time",
    "allreduce_time",
    "held_memory",
    "host_bound",
    "in_flight",
    "interleaved_held",
    "interleaved_time",
    "pipedream_stage_time",
    "plan_times",
    "price_stage",
    "stage_memory",
    "zero_bubble_time",
]

Real = TypeVar("Real", float, FloatArray)  # a number, or numbers elementwise


#: ``none``: every stage keeps its activations; ``all``: every stage recomputes; ``auto``: a stage
#: recomputes only where it does not fit the memory limit otherwise.
RECOMPUTE_MODES = ("none", "all", "auto")

#: the share of a layer's backward time that is its weight gradient (W), the rest being its input
#: gradient (B). The profile measures one fused backward, so this is an assumption: the zero-bubble
#: paper's T_B = T_W for transformer layers, where both are one matrix product of the same size per
#: linear layer (dX = dY W^T, dW = X^T dY). Convolutions are about the same; element-wise layers have
#: no W and are overcharged by it, which a measured split would fix.
W_SHARE = 0.5

#: the schedules :func:`plan_times` prices.
PRICED = ("pipedream", "1f1b", "gpipe", "zb1p", "interleaved", "zbv")


@dataclass(frozen=True)
class StageLoad:
    """What one stage carries, for one minibatch of the profile's batch size.

    Attributes:
        compute_s: forward+backward seconds of its layers on one device.
        param_bytes: parameter bytes of its layers.
        saved_bytes: activation bytes its layers keep for backward.
        in_bytes: activation bytes it receives from earlier stages (0 for the first stage).
        out_bytes: activation bytes it sends to later stages (0 for the last stage).
        forward_s: forward seconds of its layers on one device (what recomputation repeats); None: a
            third of ``compute_s`` (backward twice forward).
        input_bytes: bytes of every tensor its forward takes (the model's inputs on the first
            stage, relayed tensors included): what a recomputing stage keeps per item in flight.
            Unlike ``in_bytes`` it is never zeroed for cut pricing.
        copy_bytes: bytes of the tied weights it holds a copy of (``memory.copy_bytes``): memory only,
            their gradients' sync is not priced.
        largest_param_bytes: the largest of its layers' parameter bytes (a tied copy counted): the
            gradient a replica that accumulates holds beside the sum.
    """

    compute_s: float
    param_bytes: float
    saved_bytes: float
    in_bytes: float
    out_bytes: float
    forward_s: float | None = None
    input_bytes: float = 0.0
    copy_bytes: float = 0.0
    largest_param_bytes: float = 0.0

    @property
    def forward_time(self) -> float:
        """Forward seconds: ``forward_s``, or a third of ``compute_s`` where not measured."""
        return self.compute_s / 3.0 if self.forward_s is None else self.forward_s

    @property
    def forward_share(self) -> float:
        """The forward's part of ``compute_s``."""
        if self.compute_s <= 0:
            return 1.0 / 3.0
        return self.forward_time / self.compute_s


@dataclass(frozen=True)
class StagePrice:
    """A stage's cost on one device: compute seconds per minibatch (recomputation included, before
    dividing by replicas) and peak memory bytes."""

    compute_s: float
    memory_bytes: int


@dataclass(frozen=True)
class StageTimes:
    """Per-stage times of a plan and the resulting time per minibatch."""

    compute_s: tuple[float, ...]
    comm_s: tuple[float, ...]
    stage_s: tuple[float, ...]
    time_per_minibatch_s: float
    bubble_fraction: float


def pipedream_stage_time(
    compute_s: FloatArray | float,
    param_bytes: FloatArray | float,
    replicas: FloatArray | int,
    bandwidth: float,
    inner: int = 1,
) -> FloatArray:
    """PipeDream's replicated stage time: (C + 4(r-1)P/(rB)/inner) / r."""
    r = np.asarray(replicas, dtype=np.float64)
    sync = 4.0 * (r - 1.0) * np.asarray(param_bytes) / (bandwidth * r) / inner
    return np.asarray((np.asarray(compute_s) + sync) / r, dtype=np.float64)


def activation_time(nbytes: Real, replicas: Real | int, bandwidth: float) -> Real:
    """PipeDream's charge for activations crossing a cut: forward send plus backward gradient
    (elementwise over arrays)."""
    return 2.0 * nbytes / (bandwidth * replicas)


def allreduce_time(param_bytes: Real, replicas: Real | int, bandwidth: float) -> Real:
    """Gradient synchronisation of a replicated stage, with PipeDream's 4(r-1)P/(rB) volume
    (elementwise over arrays)."""
    return 4.0 * (replicas - 1) * param_bytes / (bandwidth * replicas)


def host_bound(rank_compute_s: Sequence[float], per_host: int, cores: int | None, threads: int) -> float:
    """Seconds per minibatch the busiest host needs where devices are CPU processes (0 for GPUs).

    Ranks ``h*per_host .. (h+1)*per_host - 1`` share host ``h``'s cores, and a process computes on
    ``threads`` of them, so at most ``cores / threads`` ranks (at least one, at most ``per_host``) run at
    once: the host's compute seconds per minibatch, over that, bound the time per minibatch from below
    however well the stages balance. ``rank_compute_s[r]`` is rank r's compute per minibatch.
    """
    if cores is None or not rank_compute_s:
        return 0.0
    at_once = max(1.0, min(float(per_host), cores / threads))
    hosts = range(0, len(rank_compute_s), per_host)
    return max(sum(rank_compute_s[h : h + per_host]) for h in hosts) / at_once


def in_flight(
    schedule: str, position: int, replicas: Sequence[int], microbatches: int, virtual: int = 1
) -> int:
    """Minibatches (pipedream) or microbatches (1f1b, gpipe) a replica of stage ``position`` holds.

    pipedream: PipeDream's NOAM, ceil(devices from this stage to the end / this stage's replicas),
    which is ``runtime.schedule.warmup + 1``: the minibatches (and weight versions) one replica holds;
    1f1b: min(stages - position, M); gpipe: all M; zb1p: min(stages, M) on every stage, since a
    unit's graph lives until its W and stage ``position`` defers ``position`` Ws
    (``runtime.schedule``): 1F1B's stage-0 peak everywhere. interleaved (``virtual`` stages per
    rank, stage ``position`` being chunk ``position // p`` of rank ``position mod p``): the units of
    this chunk it holds at most in Megatron's order (:func:`interleaved_held`).
    """
    if schedule == "pipedream":
        return math.ceil(sum(replicas[position:]) / replicas[position])
    if schedule == "1f1b":
        return min(len(replicas) - position, microbatches)
    if schedule == "gpipe":
        return microbatches
    if schedule == "zb1p":
        return min(len(replicas), microbatches)
    if schedule == "interleaved":
        return interleaved_held(position, len(replicas) // virtual, virtual, microbatches)
    if schedule == "zbv":  # (counted from zbv's lists, F to W: partitioner.optimizer.zbv)
        from partitioner.optimizer.zbv import zbv_held

        return zbv_held(position, len(replicas) // 2, microbatches)
    raise PlanError(f"unknown schedule {schedule!r}; use {', '.join(PRICED)}")


def interleaved_held(position: int, ranks: int, virtual: int, microbatches: int) -> int:
    """Units of stage ``position`` (chunk ``position // ranks`` of rank ``position mod ranks``) held
    at once at most under interleaved: played from that rank's own list
    (``runtime.schedule.interleaved_rank``; one chunk per rank is 1f1b's ``min(p - r, M)``). The
    rank holds at most its Megatron warm-up + 1 units in all, ``(v - 1) p + 2 (p - r - 1) + 1``, but
    not every chunk peaks at the same moment: summing the chunks' peaks, as a device's memory does,
    is an upper bound (rank 0 of p = 4, v = 2, M = 8: 8 + 4 = 12 units against 11 at once)."""
    return _chunk_peaks(position % ranks, ranks, virtual, microbatches)[position // ranks]


@functools.lru_cache(maxsize=256)
def _chunk_peaks(rank: int, ranks: int, virtual: int, microbatches: int) -> tuple[int, ...]:
    live, peak = [0] * virtual, [0] * virtual
    for a in interleaved_rank(rank, ranks, virtual, microbatches):
        if a.kind in "FB":
            chunk = a.stage // ranks
            live[chunk] += 1 if a.kind == "F" else -1
            peak[chunk] = max(peak[chunk], live[chunk])
    return tuple(peak)


def stage_memory(
    load: StageLoad,
    schedule: str,
    position: int,
    replicas: Sequence[int],
    microbatches: int,
    optimizer: str,
    recompute: bool = False,
) -> int:
    """Peak bytes on one device of a stage (``memory.peak_bytes``).

    pipedream keeps one weight version per minibatch in flight (weight stashing) and each replica
    runs whole minibatches; the synchronous schedules split each microbatch over the replicas, and
    a replica with more than one microbatch per step accumulates gradients.
    """
    held = in_flight(schedule, position, replicas, microbatches)
    share = 1 if schedule == "pipedream" else microbatches * replicas[position]
    accumulates = schedule != "pipedream" and microbatches > replicas[position]
    return held_memory(load, schedule, held, share, optimizer, recompute, accumulates)


def held_memory(
    load: StageLoad,
    schedule: str,
    held: int,
    share: int,
    optimizer: str,
    recompute: bool,
    accumulates: bool = False,
) -> int:
    """Peak bytes of one device of a stage holding ``held`` items, each ``1/share`` of a minibatch,
    accumulating gradients or not: :func:`~partitioner.optimizer.pricing.memory.peak_bytes` of the stage's
    bytes. Shared by the cost model and the simulation (which counts ``held`` itself)."""
    params = load.param_bytes + load.copy_bytes
    transient = float(transient_bytes(params, load.largest_param_bytes, schedule)) if accumulates else 0.0
    return peak_bytes(
        params, load.saved_bytes, held, share, schedule, optimizer, transient, load.input_bytes, recompute
    )


def price_stage(
    load: StageLoad,
    schedule: str,
    position: int,
    replicas: Sequence[int],
    microbatches: int,
    optimizer: str,
    recompute: bool,
) -> StagePrice:
    """A stage's compute time and peak memory, with or without activation recomputation: the one
    place every memory check and time of a recomputing stage comes from."""
    compute = load.compute_s + (load.forward_time if recompute else 0.0)
    memory = stage_memory(load, schedule, position, replicas, microbatches, optimizer, recompute)
    return StagePrice(compute, memory)


def plan_times(
    loads: Sequence[StageLoad],
    replicas: Sequence[int],
    bandwidths: Sequence[float],
    schedule: str,
    microbatches: int,
    virtual: int = 1,
) -> StageTimes:
    """Time per minibatch of a plan; ``bandwidths[i]`` is what stage i's replicas and cuts use;
    ``virtual``: stages per rank (interleaved)."""
    if schedule == "pipedream":
        return _pipedream_times(loads, replicas, bandwidths)
    if schedule in ("1f1b", "gpipe"):
        return _sync_times(loads, replicas, bandwidths, microbatches)
    if schedule == "zb1p":
        return _zero_bubble_times(loads, replicas, bandwidths, microbatches)
    if schedule == "interleaved":
        return _interleaved_times(loads, replicas, bandwidths, microbatches, virtual)
    if schedule == "zbv":
        from partitioner.optimizer.zbv import zbv_times

        return zbv_times(loads, replicas, bandwidths, microbatches)
    raise PlanError(f"unknown schedule {schedule!r}; use {', '.join(PRICED)}")


def _pipedream_times(
    loads: Sequence[StageLoad], replicas: Sequence[int], bandwidths: Sequence[float]
) -> StageTimes:
    compute, comm, total = [], [], []
    for load, r, bw in zip(loads, replicas, bandwidths, strict=True):
        busy = float(pipedream_stage_time(load.compute_s, load.param_bytes, r, bw))
        edge = max(activation_time(load.in_bytes, r, bw), activation_time(load.out_bytes, r, bw))
        compute.append(load.compute_s / r)
        comm.append(edge + allreduce_time(load.param_bytes, r, bw) / r)
        total.append(max(busy, edge))
    slowest = max(total)
    bubble = 1.0 - sum(total) / (len(total) * slowest) if slowest > 0 else 0.0
    return StageTimes(tuple(compute), tuple(comm), tuple(total), slowest, bubble)


def _microbatch_parts(
    loads: Sequence[StageLoad], replicas: Sequence[int], bandwidths: Sequence[float], m: int
) -> tuple[list[float], list[float], list[float], list[float], list[float], list[float], float]:
    """The synchronous schedules' terms: per stage, one microbatch's forward and backward on a
    replica, its cut traffic (out and back), their sum, compute and communication per minibatch
    on a replica; and the largest gradient all-reduce."""
    fwd, bwd, link, micro, compute, comm = [], [], [], [], [], []
    sync = 0.0
    for load, r, bw in zip(loads, replicas, bandwidths, strict=True):
        each = load.compute_s / (r * m)
        act = activation_time(load.out_bytes, r, bw) / m
        fwd.append(each * load.forward_share)
        bwd.append(each * (1.0 - load.forward_share))
        link.append(act)
        micro.append(each + act)
        compute.append(load.compute_s / r)
        sync = max(sync, allreduce_time(load.param_bytes, r, bw))
        comm.append(act * m + allreduce_time(load.param_bytes, r, bw))
    return fwd, bwd, link, micro, compute, comm, sync


def _sync_times(
    loads: Sequence[StageLoad], replicas: Sequence[int], bandwidths: Sequence[float], m: int
) -> StageTimes:
    """Sum of one microbatch's stage times + (M-1) slowest + the largest all-reduce."""
    _, _, _, micro, compute, comm, sync = _microbatch_parts(loads, replicas, bandwidths, m)
    time = sum(micro) + (m - 1) * max(micro) + sync
    busy = sum(c / m for c in compute) * m
    bubble = 1.0 - busy / (len(loads) * time) if time > 0 else 0.0
    return StageTimes(tuple(compute), tuple(comm), tuple(micro), time, bubble)


def zero_bubble_time(
    forward: Sequence[float], backward: Sequence[float], link: Sequence[float], microbatches: int
) -> float:
    """ZB-H1's time for one minibatch (no all-reduce) from one microbatch's per-stage times.

    ``backward`` is split by :data:`W_SHARE` into B and W; ``link`` is a stage's activation traffic
    per microbatch (out and back), a latency that overlaps compute. Two bounds, the larger wins. The
    critical path: one microbatch's forwards, input backwards and links through every stage, M - 1
    more of the slowest stage's F + B, and stage 0's last W. The busiest stage s: M microbatches of
    its F + B + W, plus, for every other stage, what it adds to the fill and drain (F + B + link - W:
    its deferred Ws overlap the drain). With equal stages and F = B = W = t this is ``3Mt + (p-1)t``
    for M >= p: a bubble of (p - 1)(T_F + T_B - T_W), the paper's, a third of 1F1B's 3(p - 1)t.
    It is exact against the event simulation of ``runtime.schedule``'s lists on equal stages; on 600
    random chains of unequal stages and links, median ratio 1.00, 99% within 10%, all within 16%
    (tests/partitioner/optimizer/test_zero_bubble.py).
    """
    b = [t * (1.0 - W_SHARE) for t in backward]
    w = [t * W_SHARE for t in backward]
    e = [f + bi + a for f, bi, a in zip(forward, b, link, strict=True)]
    busy = [f + t for f, t in zip(forward, backward, strict=True)]
    s = max(range(len(busy)), key=busy.__getitem__)
    path = sum(e) + (microbatches - 1) * max(f + bi for f, bi in zip(forward, b, strict=True)) + w[0]
    stage = microbatches * busy[s] + sum(e[k] - w[k] for k in range(len(e)) if k != s)
    return max(path, stage)


def _zero_bubble_times(
    loads: Sequence[StageLoad], replicas: Sequence[int], bandwidths: Sequence[float], m: int
) -> StageTimes:
    """:func:`zero_bubble_time` + the largest all-reduce; per-stage times as ``_sync_times``'."""
    fwd, bwd, link, micro, compute, comm, sync = _microbatch_parts(loads, replicas, bandwidths, m)
    time = zero_bubble_time(fwd, bwd, link, m) + sync
    bubble = 1.0 - sum(compute) / (len(loads) * time) if time > 0 else 0.0
    return StageTimes(tuple(compute), tuple(comm), tuple(micro), time, bubble)


def interleaved_time(
    forward: Sequence[float], backward: Sequence[float], link: Sequence[float], microbatches: int, ranks: int
) -> float:
    """Interleaved 1F1B's time for one minibatch (no all-reduce) from one microbatch's per-stage
    times, stage ``s`` on rank ``s mod ranks``; ``link``: a stage's activation traffic per
    microbatch (out and back). A lower bound, the largest of three:

    - rank ``r`` works ``M`` times its chunks' F + B (``W_r``), and cannot start before microbatch
      0's forwards through stages ``0 .. r-1`` have reached it, nor finish before the last backward
      has gone back through them: ``M W_r + sum_{s<r}(F_s + B_s + link_s)``;
    - the same for one stage ``k`` alone: ``M (F_k + B_k) + sum_{s<k}(F_s + B_s + link_s)``;
    - one microbatch's trip through every stage.

    With equal stages of time t (F + B) it is ``(v M + p - 1) t``: the bubble ``(p - 1) / (v M)``
    of Megatron's paper, exact against the event simulation of
    ``runtime.schedule.build_interleaved``'s lists. On unequal stages a slow stage also stalls the
    ranks after it within each round of ``p`` microbatches, which no term here charges: on 600
    random chains the simulation is 1.00-1.3x this, median 1.03
    (tests/partitioner/optimizer/test_interleaved_cost.py).
    """
    e = [f + b + a for f, b, a in zip(forward, backward, link, strict=True)]
    fill = [0.0]
    for t in e:
        fill.append(fill[-1] + t)
    work = [0.0] * ranks
    for s, (f, b) in enumerate(zip(forward, backward, strict=True)):
        work[s % ranks] += f + b
    by_rank = max(microbatches * w + fill[r] for r, w in enumerate(work))
    by_stage = max(
        microbatches * (f + b) + fill[k] for k, (f, b) in enumerate(zip(forward, backward, strict=True))
    )
    return max(by_rank, by_stage, fill[-1])


def _interleaved_times(
    loads: Sequence[StageLoad], replicas: Sequence[int], bandwidths: Sequence[float], m: int, virtual: int
) -> StageTimes:
    """:func:`interleaved_time` + the largest all-reduce (none without replicas); per-stage times as
    ``_sync_times``'; the bubble is the ranks' idle share."""
    if any(r != 1 for r in replicas) or len(loads) % virtual:
        raise PlanError(f"interleaved needs one device per stage and {virtual} stages per rank")
    fwd, bwd, link, micro, compute, comm, _ = _microbatch_parts(loads, replicas, bandwidths, m)
    ranks = len(loads) // virtual
    time = interleaved_time(fwd, bwd, link, m, ranks)
    bubble = 1.0 - sum(compute) / (ranks * time) if time > 0 else 0.0
    return StageTimes(tuple(compute), tuple(comm), tuple(micro), time, bubble)
