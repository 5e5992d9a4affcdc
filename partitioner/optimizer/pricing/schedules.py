"""One :class:`ScheduleModel` per schedule: how the planner prices it. The registry (:data:`MODELS`)
is the only place that tells schedules apart by name; everything else asks it.

A model holds its time per minibatch (a closed form over its stages' :class:`~.stage.StageLoad`),
the items a stage holds in flight (counted from the runtime's own lists unless a closed form is
given), whether the event simulation of those lists prices its plans, and how it lays stages on
GPUs. Its twin :class:`runtime.schedule.Schedule` (:attr:`ScheduleModel.runtime`) builds the lists
and says whether the schedule flushes, stashes weights or splits its backward.

- ``pipedream`` (PipeDream's objective): the slowest stage's time, :func:`~.stage.stage_time`.
- ``1f1b``, ``gpipe``: M microbatches flow through, so a minibatch takes the sum of one
  microbatch's stage times, plus (M-1) slowest stages, plus the largest gradient all-reduce.
- ``zb1p`` (zero bubble H1): each backward split into B (on the critical path) and W (deferred into
  the bubbles), :func:`zero_bubble_time` and :data:`~.stage.W_SHARE`.
- ``interleaved`` (Megatron's virtual stages) and ``zbv`` (ZB-V): lower bounds in closed form
  (:func:`interleaved_time`, :func:`zbv_time`) rank candidate cuts; the simulation prices the plan.

Adding a schedule is one entry here and its builder in ``runtime.schedule`` (docs/optimizer-pricing.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from partitioner.errors import PlanError
from partitioner.graph import Profile, at_microbatches, split_backward
from partitioner.optimizer.pricing.stage import (
    W_SHARE,
    StageLoad,
    StageTimes,
    activation_time,
    allreduce_time,
    microbatch_compute,
    microbatch_link,
    stage_time,
)
from partitioner.plan import Link
from runtime.schedule import REGISTRY, Schedule, actions, layout_of

__all__ = [
    "MODELS",
    "ScheduleModel",
    "held_by_depth",
    "in_flight",
    "interleaved_time",
    "model",
    "plan_times",
    "priced_profile",
    "replica_held",
    "with_actions",
    "zbv_time",
    "zero_bubble_time",
]

Times = Callable[[Sequence[StageLoad], Sequence[int], Sequence[Link], int, int], StageTimes]
"""(loads, replicas, links, microbatches, virtual stages) -> a plan's times."""


@dataclass(frozen=True)
class ScheduleModel:
    """How the planner prices one schedule.

    Attributes:
        name: the schedule (a key of ``runtime.schedule.REGISTRY`` too).
        times: its time per minibatch and per-stage times (:data:`Times`).
        in_flight: (position, replicas, microbatches, virtual) -> items (minibatches or
            microbatches) a device of that stage holds at once; None: counted from the runtime's
            own list of one minibatch (:func:`played_in_flight`).
        simulated: plans are priced by the event simulation of the runtime's lists; ``times`` ranks
            candidates in the searches (exact on equal stages without link latency; a message's
            latency is a delay the simulation overlaps where the lists let it, the closed forms
            charge it per microbatch or not at all: docs/optimizer-pricing.md).
        sync_sum: ``times`` is the synchronous sum the exact search minimises (its optimum is then
            this schedule's).
        holds_all: every stage holds all M microbatches (the exact search's memory model is exact).
        held_from_end: a stage's items in flight (:meth:`held`, :meth:`later`) depend only on its
            replicas and the stages from it to the end (1f1b's warm-up is the stages after it): the
            exact search then checks memory at each stage's depth (:func:`held_by_depth`).
        virtual_stages: stages per GPU of a schedule that lays several on each (``zbv``'s V: 2);
            None: as many as asked (``interleaved``); 1 elsewhere.
        auto_virtual: the virtual stage counts ``--schedule auto`` tries.
        seed_schedule: a laid-out schedule's first candidate cuts are this schedule's exact
            straight plan over one device per stage.
    """

    name: str
    times: Times
    in_flight: Callable[[int, Sequence[int], int, int], int] | None = None
    simulated: bool = False
    sync_sum: bool = False
    holds_all: bool = False
    held_from_end: bool = False
    virtual_stages: int | None = 1
    auto_virtual: tuple[int, ...] = (1,)
    seed_schedule: str = ""

    @property
    def runtime(self) -> Schedule:
        """The runtime's entry: builder, flush, weight stashing, split backward, placement."""
        return REGISTRY[self.name]

    @property
    def asynchronous(self) -> bool:
        """Whole minibatches, no flush (pipedream): priced per minibatch, one microbatch each."""
        return not self.runtime.flushes

    @property
    def laid_out(self) -> bool:
        """Several one-device stages on each GPU in a fixed pattern (no replicas)."""
        return self.runtime.placement is not None

    def microbatches(self, m: int) -> int:
        """The microbatches its cost model prices: 1 for a schedule of whole minibatches."""
        return 1 if self.asynchronous else m

    def actions(self, m: int) -> int:
        """Compute actions a stage runs per minibatch, its replicas together: a forward and a backward
        per item, and a W per item where the backward is split (what ``Cluster.action_s`` is paid
        on: :func:`with_actions`)."""
        return self.microbatches(m) * (3 if self.runtime.split_backward else 2)

    def virtual(self, asked: int) -> int:
        """Stages per GPU, given the count asked for."""
        return asked if self.virtual_stages is None else self.virtual_stages

    def default_microbatches(self, gpus: int, virtual: int) -> int:
        """Microbatches when none are asked: 1 (whole minibatches), 2 per GPU where several stages
        share a GPU (Megatron's order wants a multiple of the GPUs; zbv fills from 2 x GPUs - 1 on),
        else 4."""
        if self.asynchronous:
            return 1
        return 2 * gpus if self.laid_out and self.virtual(virtual) > 1 else 4

    def held(self, position: int, replicas: Sequence[int], microbatches: int, virtual: int) -> int:
        """Items a device of stage ``position`` holds at once (:attr:`in_flight`); a replica of a
        flushing schedule its share of the stage's (:func:`replica_held`)."""
        if self.in_flight is not None:
            return self.in_flight(position, replicas, microbatches, virtual)
        stage = played_in_flight(self.name, position, len(replicas), microbatches, self.virtual(virtual))
        return replica_held(stage, replicas[position])

    def later(self, position: int, replicas: Sequence[int], microbatches: int, virtual: int) -> int:
        """Items a device of stage ``position`` holds at most while a backward after its first of the
        step frees one (a split backward's W): the backwards that add to gradients already made
        (the first makes them), played from the runtime's own list. gpipe: one item fewer than
        ``held``; 1f1b: ``held`` where a forward comes between its first two backwards. ``held``
        for pipedream, whose replicas never add one minibatch's gradient to another's, and for a
        split backward, whose W holds more than the item it frees (resnet18's zb1p stage 0 at
        M = 2, ``run --measure-memory``: 41.5 MiB, 1.07 of the figure with one item fewer, 0.91
        of this one)."""
        if self.in_flight is not None or self.runtime.split_backward:
            return self.held(position, replicas, microbatches, virtual)
        v, r = self.virtual(virtual), replicas[position]
        stage = played_in_flight(self.name, position, len(replicas), microbatches, v, after=r)
        return replica_held(stage, r)

    def between(self, position: int, replicas: Sequence[int], microbatches: int, virtual: int) -> int:
        """Items a device of stage ``position`` holds between their B and their W at once, keeping
        what W needs (``Node.deferred_bytes``): played from the runtime's own list; 0 where the
        backward is not split."""
        if not self.runtime.split_backward:
            return 0
        v = self.virtual(virtual)
        stage = played_in_flight(self.name, position, len(replicas), microbatches, v, start="B")
        return replica_held(stage, replicas[position])


@functools.lru_cache(maxsize=16)
def held_by_depth(
    name: str, depth: int, replicas: int, microbatches: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(held, later) of a stage of ``r`` replicas ``d`` stages from the end (itself counted), as
    ``[d - 1][r - 1]`` for d <= ``depth``, r <= ``replicas``: :meth:`ScheduleModel.held` and
    :meth:`ScheduleModel.later` of the first of ``d`` stages, which is every stage ``d`` from the end
    where the model is ``held_from_end`` (the exact search reads them; a test holds them equal at
    every position)."""
    sched = model(name)
    held, later = [], []
    for d in range(1, depth + 1):
        rows = [(r, *([1] * (d - 1))) for r in range(1, replicas + 1)]
        held.append(tuple(sched.held(0, row, microbatches, 1) for row in rows))
        later.append(tuple(sched.later(0, row, microbatches, 1) for row in rows))
    return tuple(held), tuple(later)


def replica_held(stage_items: int, replicas: int) -> int:
    """Items the busiest replica of a flushing stage holds when the stage as one holds ``stage_items``:
    ceil(items / r), as the runtime hands microbatches round-robin (docs/optimizer-pricing.md)."""
    return -(-stage_items // replicas)


def _pipedream_in_flight(position: int, replicas: Sequence[int], microbatches: int, virtual: int) -> int:
    """PipeDream's NOAM: ceil(devices from this stage to the end / this stage's replicas), which is
    ``runtime.schedule.warmup + 1``: the minibatches (and weight versions) one replica holds."""
    return math.ceil(sum(replicas[position:]) / replicas[position])


@functools.lru_cache(maxsize=1024)
def _rank_peaks(
    name: str, stages: int, virtual: int, microbatches: int, rank: int, start: str = "F", after: int = -1
) -> dict[int, int]:
    """Per stage of ``rank``, the most units whose graph it holds at once over one minibatch of the
    runtime's list: from a unit's ``start`` action (its F, or a split backward's B) to its W (split
    backward) or B. ``after`` >= 0: counted only at a freeing action after the stage's first
    ``after`` of them (the unit it frees among those held); 0 where there is none."""
    peaks = _played_peaks(name, stages, virtual, microbatches, rank, start)
    if after < 0:
        return {stage: most for stage, (most, _) in peaks.items()}
    return {stage: max(freeing[after:], default=0) for stage, (_, freeing) in peaks.items()}


@functools.lru_cache(maxsize=256)
def _played_peaks(
    name: str, stages: int, virtual: int, microbatches: int, rank: int, start: str
) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Per stage of ``rank``, played once from its list: the most units it holds at once, and the
    units it holds at each freeing action, in order (the i-th after i of them): what
    :func:`_rank_peaks` reads for every ``after``."""
    layout = layout_of(name, stages // virtual, virtual)
    release = "W" if REGISTRY[name].split_backward else "B"
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    freeing: dict[int, list[int]] = {}
    for a in actions(name, layout, rank, microbatches, range(1)):
        if a.kind in (start, release):
            live[a.stage] = live.get(a.stage, 0) + (1 if a.kind == start else 0)
            peak[a.stage] = max(peak.get(a.stage, 0), live[a.stage])
            freeing.setdefault(a.stage, [])
            if a.kind == release:
                freeing[a.stage].append(live[a.stage])
                live[a.stage] -= 1
    return {stage: (most, tuple(freeing[stage])) for stage, most in peak.items()}


@functools.lru_cache(maxsize=4096)  # (pure: every stage of every plan a search prices asks)
def played_in_flight(
    name: str, position: int, stages: int, microbatches: int, virtual: int = 1, start: str = "F",
    after: int = -1,
) -> int:  # fmt: skip
    """Units stage ``position`` holds at once at most, played from its rank's own list (a replicated
    stage as one: its replicas share each minibatch's microbatches), from each unit's ``start``
    action (its F, or a split backward's B) to the action that frees it; ``after`` >= 0: only while
    a freeing action after the stage's first ``after`` runs (:meth:`ScheduleModel.later`). Under
    ``interleaved`` or ``zbv`` a device's memory sums its chunks' peaks, which need not coincide: an
    upper bound by about one unit of one chunk (rank 0 of p = 4, v = 2, M = 8: 8 + 4 = 12 units
    against 11)."""
    layout = layout_of(name, stages // virtual, virtual)
    return _rank_peaks(name, stages, virtual, microbatches, layout[position][0], start, after)[position]


def _pipedream_times(
    loads: Sequence[StageLoad], replicas: Sequence[int], links: Sequence[Link], m: int, virtual: int
) -> StageTimes:
    """The slowest stage (:func:`~.stage.stage_time`) sets the pace."""
    compute, comm, total = [], [], []
    for load, r, wire in zip(loads, replicas, links, strict=True):
        cut = max(load.in_bytes, load.out_bytes)
        compute.append(load.compute_s / r)
        comm.append(activation_time(cut, r, wire) + allreduce_time(load.param_bytes, r, wire) / r)
        total.append(float(stage_time(load.compute_s, load.param_bytes, r, wire, act=cut)))
    slowest = max(total)
    bubble = 1.0 - sum(total) / (len(total) * slowest) if slowest > 0 else 0.0
    return StageTimes(tuple(compute), tuple(comm), tuple(total), slowest, bubble)


def _microbatch_parts(
    loads: Sequence[StageLoad], replicas: Sequence[int], links: Sequence[Link], m: int
) -> tuple[list[float], list[float], list[float], list[float], list[float], list[float], float]:
    """The synchronous schedules' terms: per stage, one microbatch's forward and backward on a
    replica, its cut traffic (out and back), their sum, compute and communication per minibatch
    on a replica; and the largest gradient all-reduce."""
    fwd, bwd, link, micro, compute, comm = [], [], [], [], [], []
    sync = 0.0
    for load, r, wire in zip(loads, replicas, links, strict=True):
        each = microbatch_compute(load.compute_s, r, m)
        act = microbatch_link(load.out_bytes, r, m, wire)
        fwd.append(each * load.forward_share)
        bwd.append(each * (1.0 - load.forward_share))
        link.append(act)
        micro.append(each + act)
        compute.append(load.compute_s / r)
        sync = max(sync, allreduce_time(load.param_bytes, r, wire))
        comm.append(act * m + allreduce_time(load.param_bytes, r, wire))
    return fwd, bwd, link, micro, compute, comm, sync


def _sync_times(
    loads: Sequence[StageLoad], replicas: Sequence[int], links: Sequence[Link], m: int, virtual: int
) -> StageTimes:
    """Sum of one microbatch's stage times + (M-1) slowest + the largest all-reduce."""
    _, _, _, micro, compute, comm, sync = _microbatch_parts(loads, replicas, links, m)
    time = sum(micro) + (m - 1) * max(micro) + sync
    busy = sum(c / m for c in compute) * m
    bubble = 1.0 - busy / (len(loads) * time) if time > 0 else 0.0
    return StageTimes(tuple(compute), tuple(comm), tuple(micro), time, bubble)


def zero_bubble_time(
    forward: Sequence[float],
    backward: Sequence[float],
    link: Sequence[float],
    microbatches: int,
    w_share: Sequence[float] | None = None,
) -> float:
    """ZB-H1's time for one minibatch (no all-reduce) from one microbatch's per-stage times: the larger
    of the critical path and the busiest stage, exact on equal stages (the bounds and their measured
    error: docs/optimizer-pricing.md). ``w_share``: W's part of each stage's backward
    (``StageLoad.weight_share``; default :data:`~.stage.W_SHARE`)."""
    b, w = _split(backward, w_share)
    e = [f + bi + a for f, bi, a in zip(forward, b, link, strict=True)]
    busy = [f + t for f, t in zip(forward, backward, strict=True)]
    s = max(range(len(busy)), key=busy.__getitem__)
    path = sum(e) + (microbatches - 1) * max(f + bi for f, bi in zip(forward, b, strict=True)) + w[0]
    stage = microbatches * busy[s] + sum(e[k] - w[k] for k in range(len(e)) if k != s)
    return max(path, stage)


def _split(backward: Sequence[float], w_share: Sequence[float] | None) -> tuple[list[float], list[float]]:
    """Each backward's B and W parts, W being ``w_share`` of it (:data:`~.stage.W_SHARE` where None)."""
    shares = [W_SHARE] * len(backward) if w_share is None else list(w_share)
    w = [t * x for t, x in zip(backward, shares, strict=True)]
    return [t - wi for t, wi in zip(backward, w, strict=True)], w


def _zero_bubble_times(
    loads: Sequence[StageLoad], replicas: Sequence[int], links: Sequence[Link], m: int, virtual: int
) -> StageTimes:
    """:func:`zero_bubble_time` + the largest all-reduce; per-stage times as ``_sync_times``'."""
    shares = [ld.weight_share() for ld in loads]
    return _bounded(
        loads, replicas, links, m, len(loads), lambda f, b, a: zero_bubble_time(f, b, a, m, shares), True
    )


def _bounded(
    loads: Sequence[StageLoad], replicas: Sequence[int], links: Sequence[Link], m: int, devices: int,
    bound: Callable[[list[float], list[float], list[float]], float], sync: bool = False,
) -> StageTimes:  # fmt: skip
    """A closed form's times: ``bound`` of the forward, backward and link times of one microbatch
    (+ the largest all-reduce with ``sync``); the bubble is the ``devices``' idle share."""
    fwd, bwd, link, micro, compute, comm, allreduce = _microbatch_parts(loads, replicas, links, m)
    time = bound(fwd, bwd, link) + allreduce if sync else bound(fwd, bwd, link)
    bubble = 1.0 - sum(compute) / (devices * time) if time > 0 else 0.0
    return StageTimes(tuple(compute), tuple(comm), tuple(micro), time, bubble)


def interleaved_time(
    forward: Sequence[float], backward: Sequence[float], link: Sequence[float], microbatches: int, ranks: int
) -> float:
    """Interleaved 1F1B's time for one minibatch (no all-reduce) from one microbatch's per-stage times,
    stage ``s`` on rank ``s mod ranks``: a lower bound, exact on equal stages (its three terms and
    measured error: docs/optimizer-pricing.md)."""
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
    loads: Sequence[StageLoad], replicas: Sequence[int], links: Sequence[Link], m: int, virtual: int
) -> StageTimes:
    """:func:`interleaved_time` (no all-reduce: no replicas); per-stage times as ``_sync_times``';
    the bubble is the ranks' idle share."""
    if any(r != 1 for r in replicas) or len(loads) % virtual:
        raise PlanError(f"interleaved needs one device per stage and {virtual} stages per rank")
    ranks = len(loads) // virtual
    return _bounded(loads, replicas, links, m, ranks, lambda f, b, a: interleaved_time(f, b, a, m, ranks))


def zbv_time(
    forward: Sequence[float],
    backward: Sequence[float],
    link: Sequence[float],
    microbatches: int,
    w_share: Sequence[float] | None = None,
) -> float:
    """A lower bound on zbv's time for one minibatch (no all-reduce) from one microbatch's per-stage
    times on ``2p`` stages, rank ``r`` hosting ``r`` and ``2p - 1 - r`` (docs/optimizer-pricing.md);
    ``w_share`` as :func:`zero_bubble_time`'s."""
    stages = len(forward)
    if stages % 2:
        raise PlanError(f"zbv needs an even number of stages (2 per GPU), got {stages}")
    p = stages // 2
    hop = [0.0 if k == p - 1 else a / 2 for k, a in enumerate(link)]  # one way: half the traffic
    fill = [0.0]
    for f, a in zip(forward, hop, strict=True):
        fill.append(fill[-1] + f + a)
    by_rank = max(
        microbatches * sum(forward[k] + backward[k] for k in (r, stages - 1 - r)) + fill[r] for r in range(p)
    )
    b, w = _split(backward, w_share)
    trip = fill[stages - 1] + forward[-1] + sum(bi + a for bi, a in zip(b, hop, strict=True)) + w[0]
    return max(by_rank, trip)


def _zbv_times(
    loads: Sequence[StageLoad], replicas: Sequence[int], links: Sequence[Link], m: int, virtual: int
) -> StageTimes:
    """:func:`zbv_time` (no all-reduce: no replicas); per-stage times as the other schedules'; the
    bubble is the GPUs' idle share."""
    if any(r != 1 for r in replicas) or len(loads) % 2:
        raise PlanError("zbv needs one device per stage and 2 stages per GPU")
    shares = [ld.weight_share() for ld in loads]
    return _bounded(loads, replicas, links, m, len(loads) // 2, lambda f, b, a: zbv_time(f, b, a, m, shares))


MODELS: dict[str, ScheduleModel] = {
    "pipedream": ScheduleModel("pipedream", _pipedream_times, _pipedream_in_flight),
    "1f1b": ScheduleModel("1f1b", _sync_times, simulated=True, sync_sum=True, held_from_end=True),
    "gpipe": ScheduleModel("gpipe", _sync_times, simulated=True, sync_sum=True, holds_all=True),
    "zb1p": ScheduleModel("zb1p", _zero_bubble_times, simulated=True),
    "interleaved": ScheduleModel(
        "interleaved",
        _interleaved_times,
        simulated=True,
        virtual_stages=None,
        auto_virtual=(2, 3, 4),
        seed_schedule="1f1b",
    ),
    "zbv": ScheduleModel("zbv", _zbv_times, simulated=True, virtual_stages=2, seed_schedule="1f1b"),
}


def model(name: str) -> ScheduleModel:
    """The registry's model of ``name``.

    Raises:
        PlanError: an unknown schedule (the message lists the known ones).
    """
    if name not in MODELS:
        raise PlanError(f"unknown schedule {name!r}; use one of {', '.join(MODELS)}")
    return MODELS[name]


def in_flight(
    schedule: str, position: int, replicas: Sequence[int], microbatches: int, virtual: int = 1
) -> int:
    """Minibatches (pipedream) or microbatches a device of stage ``position`` holds at once."""
    return model(schedule).held(position, replicas, microbatches, virtual)


def plan_times(
    loads: Sequence[StageLoad],
    replicas: Sequence[int],
    links: Sequence[Link],
    schedule: str,
    microbatches: int,
    virtual: int = 1,
) -> StageTimes:
    """Time per minibatch of a plan; ``links[i]`` is what stage i's replicas and cuts use;
    ``virtual``: stages per rank (interleaved)."""
    return model(schedule).times(loads, replicas, links, microbatches, virtual)


def with_actions(loads: Sequence[StageLoad], action_s: float, schedule: str, m: int) -> list[StageLoad]:
    """The loads a closed form prices: each stage's compute with the runtime's ``action_s`` per
    action (:meth:`ScheduleModel.actions`), a forward's on its forward time, so a microbatch's
    forward and backward each pay one (a split backward's B and W one each: W's measured seconds
    gain one per item, and while it is not measured ``W_SHARE`` is a half, as the simulation charges
    them). What a search adds per stage is this too
    (``StateSet.stage_s``)."""
    if not action_s:
        return list(loads)
    sched = model(schedule)
    forwards, actions = sched.microbatches(m) * action_s, sched.actions(m) * action_s
    weights = forwards if sched.runtime.split_backward else 0.0  # one W action per item
    return [
        replace(
            ld,
            compute_s=ld.compute_s + actions,
            forward_s=ld.forward_time + forwards,
            weight_s=None if ld.weight_s is None else ld.weight_s + weights,
        )
        for ld in loads
    ]


def priced_profile(profile: Profile, schedule: str, forwards: int) -> Profile:
    """The profile every pricing of a ``schedule`` plan reads (the searches, the plan's price, the
    simulation, calibrate's table): :func:`~partitioner.graph.at_microbatches` at ``forwards``, and
    for a schedule that splits its backward, :func:`~partitioner.graph.split_backward`. Idempotent."""
    at = at_microbatches(profile, forwards)
    return split_backward(at) if model(schedule).runtime.split_backward else at
