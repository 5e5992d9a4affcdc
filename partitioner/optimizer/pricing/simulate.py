"""Event simulation of a plan under its schedule (timeline, bubble, peak memory per stage), playing
the runtime's own lists: the closed forms are checked against it (docs/optimizer-pricing.md)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from partitioner.errors import PlanError
from partitioner.graph import Profile
from partitioner.optimizer.pricing.price import (
    StageSpec,
    assemble,
    backward_item,
    device_shares,
    held_backward,
    held_memory,
    hosts_bound,
    laid_out_peaks,
    stage_loads,
)
from partitioner.optimizer.pricing.schedules import model, priced_profile, replica_held
from partitioner.optimizer.pricing.stage import (
    StageLoad,
    activation_time,
    allreduce_time,
    microbatch_compute,
    microbatch_link,
    stage_time,
)
from partitioner.plan import Plan
from runtime.files.atomic import write_text_atomic
from runtime.schedule import Action, Layout, build, pipeline

__all__ = [
    "Event",
    "Simulation",
    "gantt",
    "play",
    "played",
    "simulate",
    "stage_bubbles",
    "with_stage_bubbles",
    "write_chrome_trace",
]


@dataclass(frozen=True)
class Event:
    """One action on one stage: ``kind`` is F, B, W (weight gradients of a split backward) or S
    (gradient sync + optimizer step)."""

    stage: int
    kind: str
    item: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Simulation:
    """What the simulation found.

    Attributes:
        events: every action, in start order.
        time_per_minibatch_s: steady-state time per minibatch.
        bubble_fraction: idle share of the stages' time over :attr:`window_s`.
        peak_memory_bytes: per stage, the most bytes one device held.
        in_flight: per stage, the most items whose activations one device held at once.
        minibatches: how many minibatches were simulated.
        steady: whether they reach the steady state (a very large pipedream plan is simulated over
            a shorter horizon, bounded by :data:`MAX_ACTIONS`; its time and bubble are then those of
            the pipeline filling up).
        window_s: the time the stages' busy share is taken over: a flushing schedule's steady
            period (its events are one minibatch's), pipedream's whole span (0: the events' span).
    """

    events: tuple[Event, ...]
    time_per_minibatch_s: float
    bubble_fraction: float
    peak_memory_bytes: tuple[int, ...]
    in_flight: tuple[int, ...]
    minibatches: int = 1
    steady: bool = True
    window_s: float = 0.0


STEADY_MINIBATCHES = 4
"""Minibatches a flushing plan is played over: each rank starts its next minibatch when it has
stepped, not when the last rank has, so where the rank that ends a minibatch is not the one that
starts the next (zb1p with a heavier last stage, each stage's own all-reduce), the period is shorter
than one minibatch's span. The last two periods are averaged; on 300 random plans of every
flushing schedule they equal those of 16 minibatches (tests/.../pricing/test_steady.py). Under
fp16 every rank's loss-scale check meets at the step, so one minibatch is played and its span is
the period. (So do the ranks of a ``--clip-grad-norm`` run, and the stages sharing a tied weight:
not known when a plan is priced, so not played; docs/optimizer-pricing.md.)"""

MAX_ACTIONS = 100_000
"""Forwards and backwards a default pipedream simulation plays at most (about a second of Python)."""


def play(
    lists: Sequence[Sequence[Action]],
    layout: Layout,
    fwd: Sequence[float],
    bwd: Sequence[float],
    link: Sequence[float],
    wgt: Sequence[float] | None = None,
    step: Sequence[float] | None = None,
    latency: Sequence[float] | None = None,
) -> tuple[list[Event], list[int]]:
    """Run every rank's list (``lists[rank]``, its stages given by ``layout``) in order, event-driven
    (linear in the actions). Returns the events and, per stage, the most units one rank held between
    their forward and their backward (the waiting rules: docs/optimizer-pricing.md). ``wgt``: a W's
    time (``bwd`` is then the B part alone); ``step``: a stage's step (None: free, no event).

    ``link[k]``: a message's one-way time between stages k and k+1. None ``latency``: a pure delay.
    Else ``latency[k]`` of it is a delay and the rest (its bytes) occupies the cut's wire in that
    direction, messages one after another as they are sent: a link moves one message's bytes at a
    time, and many messages in flight each wait out the latency alone."""
    player = _Player(lists, layout, fwd, bwd, link, wgt, step, latency)
    ready = list(range(len(lists)))
    while ready:
        ready.extend(player.advance(ready.pop()))
    if any(p < len(acts) for p, acts in zip(player.pos, lists, strict=True)):
        raise PlanError("schedule deadlocks: an action waits for one that never runs")
    return player.events, player.held


class _Player:
    """The state of :func:`play`: when each action ended, what each rank waits for."""

    def __init__(
        self, lists: Sequence[Sequence[Action]], layout: Layout, fwd: Sequence[float], bwd: Sequence[float],
        link: Sequence[float], wgt: Sequence[float] | None, step: Sequence[float] | None,
        latency: Sequence[float] | None = None,
    ) -> None:  # fmt: skip
        self.lists, self.layout, self.step = lists, layout, step
        self.took = {"F": fwd, "B": bwd, "W": wgt or bwd}
        self.link, self.release, self.latency = link, "B" if wgt is None else "W", latency
        self.wire_free: dict[tuple[int, int], float] = {}  # (from rank, to rank): when it is free
        self.arrival: dict[tuple[str, int, int], float] = {}  # a sent message: when it arrives
        self.done: dict[tuple[str, int, int], float] = {}
        self.free, self.pos = [0.0] * len(lists), [0] * len(lists)
        self.live: dict[tuple[int, int], int] = {}
        self.held = [0] * len(layout)
        self.parked: dict[tuple[str, int, int], list[int]] = {}
        self.arrived: dict[tuple[int, int], list[int]] = {}
        self.events: list[Event] = []

    def advance(self, r: int) -> list[int]:
        """Run rank ``r`` as far as it can; the ranks its actions woke up."""
        woken: list[int] = []
        acts = self.lists[r]
        while self.pos[r] < len(acts):
            a = acts[self.pos[r]]
            if a.kind == "S":
                if self.step is not None:
                    return woken + self._arrive(r, a)
                self.pos[r] += 1
                continue
            need, delay = self._input(a)
            if need is not None and need not in self.done:
                self.parked.setdefault(need, []).append(r)
                return woken
            ready = self.arrival.get(need, self.done[need] + delay) if need is not None else 0.0
            self._run(r, a, max(self.free[r], ready))
            woken += self.parked.pop((a.kind, a.stage, a.index), [])
        return woken

    def _input(self, a: Action) -> tuple[tuple[str, int, int] | None, float]:
        """What ``a`` waits for (None: nothing) and the link delay after it."""
        k, last = a.stage, len(self.layout) - 1
        if a.kind == "W" or (a.kind == "F" and k == 0):
            return None, 0.0
        if a.kind == "F":
            return ("F", k - 1, a.index), self.link[k - 1]
        return (("B", k + 1, a.index), self.link[k]) if k < last else (("F", k, a.index), 0.0)

    def _run(self, r: int, a: Action, start: float) -> None:
        end = start + self.took[a.kind][a.stage]
        self.done[(a.kind, a.stage, a.index)] = self.free[r] = end
        if self.latency is not None and a.kind in ("F", "B"):
            cut = a.stage if a.kind == "F" else a.stage - 1
            if 0 <= cut < len(self.layout) - 1:
                self._send((a.kind, a.stage, a.index), cut, end)
        self.events.append(Event(a.stage, a.kind, a.index, start, end))
        if a.kind in ("F", self.release):
            key = (r, a.stage)
            self.live[key] = self.live.get(key, 0) + (1 if a.kind == "F" else -1)
            self.held[a.stage] = max(self.held[a.stage], self.live[key])
        self.pos[r] += 1

    def _send(self, key: tuple[str, int, int], cut: int, sent: float) -> None:
        """The message ``key`` produced at ``sent`` crosses ``cut``, after the earlier messages on
        the wire between the two ranks in that direction (cuts between the same ranks share it)."""
        assert self.latency is not None
        ends = (cut, cut + 1) if key[0] == "F" else (cut + 1, cut)
        wire = (self.layout[ends[0]][0], self.layout[ends[1]][0])
        start = max(sent, self.wire_free.get(wire, 0.0))
        self.wire_free[wire] = start + self.link[cut] - self.latency[cut]
        self.arrival[key] = self.wire_free[wire] + self.latency[cut]

    def _arrive(self, r: int, a: Action) -> list[int]:
        """Rank ``r`` reaches step ``a``; once every rank of its stage has, they all take it."""
        assert self.step is not None
        ranks = self.arrived.setdefault((a.stage, a.index), [])
        ranks.append(r)
        if len(ranks) < len(self.layout[a.stage]):
            return []
        start = max(self.free[q] for q in ranks)
        self.events.append(Event(a.stage, "S", a.index, start, start + self.step[a.stage]))
        for q in ranks:
            self.free[q] = start + self.step[a.stage]
            self.pos[q] += 1
        return list(self.arrived.pop((a.stage, a.index)))


def _flushed(plan: Plan, profile: Profile | None) -> Simulation:
    """A flushing schedule from the runtime's own lists: on the plan's ranks where
    the schedule lays several stages on each, else one rank per stage (a replicated stage as one
    server r times as fast, all-reducing at its own step), played over :data:`STEADY_MINIBATCHES`."""
    sched = model(plan.schedule)
    p = len(plan.stages)
    layout = tuple(s.ranks for s in plan.stages) if sched.laid_out else pipeline([1] * p)
    loads = _loads(plan, profile)
    fwd, bwd, link = _durations(plan, profile, loads)
    latency = [plan.cluster.slowest.latency * (ld.out_bytes > 0) for ld in loads]
    for k in range(p - 1):
        if layout[k] == layout[k + 1]:  # a hand-off inside one rank
            link[k] = latency[k] = 0.0
    wgt = None
    if sched.runtime.split_backward:
        shares = [ld.weight_share(s.recompute) for ld, s in zip(loads, plan.stages, strict=True)]
        wgt = [t * x for t, x in zip(bwd, shares, strict=True)]
        bwd = [t - w for t, w in zip(bwd, wgt, strict=True)]
        wgt = _with_action(wgt, plan)
    fwd, bwd = _with_action(fwd, plan), _with_action(bwd, plan)
    step = None
    if not sched.laid_out:  # a replicated stage all-reduces once its own part of the minibatch is done
        wire = plan.cluster.slowest
        step = [
            allreduce_time(ld.param_bytes, s.replicas, wire) for s, ld in zip(plan.stages, loads, strict=True)
        ]
    steps = 1 if plan.precision == "fp16" else STEADY_MINIBATCHES
    lists = build(plan.schedule, layout, plan.microbatches, steps=steps)
    events, held = play(lists, layout, fwd, bwd, link, wgt, step, latency)
    first, period = _steady(events, plan.microbatches, steps)
    ranks = len({r for ranks in layout for r in ranks})
    held = [replica_held(h, s.replicas) for h, s in zip(held, plan.stages, strict=True)]  # one device's
    return _simulation(plan, profile, loads, first, held, ranks, period, window=period)


def _steady(events: Sequence[Event], microbatches: int, steps: int) -> tuple[list[Event], float]:
    """The first minibatch's events (the timeline a plan shows) and the time per minibatch: one
    minibatch's span, or the mean of the last two periods (a minibatch ends with its last event)."""
    done, first = [0.0] * steps, []
    for e in events:
        n = e.item if e.kind == "S" else e.item // microbatches
        done[n] = max(done[n], e.end_s)
        first += [e] if n == 0 else []
    return first, done[0] if steps == 1 else (done[-1] - done[-3]) / 2


def _simulation(
    plan: Plan, profile: Profile | None, loads: Sequence[StageLoad], events: list[Event], held: Sequence[int],
    ranks: int, per_minibatch: float, minibatches: int = 1, steady: bool = True, window: float = 0.0,
) -> Simulation:  # fmt: skip
    """What ``ranks`` ranks' ``events`` add up to: the bubble is their idle share (steps not counted)
    over ``window`` (0: the events' span)."""
    span = window or max(e.end_s for e in events)
    busy = sum(_computing(events, plan))
    bubble = max(0.0, 1.0 - busy / (ranks * span)) if span > 0 else 0.0
    ordered = tuple(sorted(events, key=lambda e: e.start_s))
    memory = _memory(plan, profile, loads, held)
    return Simulation(ordered, per_minibatch, bubble, memory, tuple(held), minibatches, steady, window)


def _computing(events: Sequence[Event], plan: Plan) -> list[float]:
    """Seconds each F, B and W event computes: its span less the runtime's time per action it
    carries (:func:`_actions_s`), as ``run`` counts a rank's compute."""
    actions = _actions_s(plan)
    return [max(0.0, e.end_s - e.start_s - actions[e.stage]) for e in events if e.kind != "S"]


def _unflushed(plan: Plan, profile: Profile | None, minibatches: int | None) -> Simulation:
    """Every rank of a plan of whole minibatches (pipedream) from the runtime's lists: a replica's
    minibatch takes the stage's whole compute, its round's all-reduce PipeDream's 4(r-1)P/(rB)."""
    replicas = [s.replicas for s in plan.stages]
    p, wire = len(replicas), plan.cluster.slowest
    loads = _loads(plan, profile)
    alone = replace(plan, stages=tuple(replace(s, replicas=1) for s in plan.stages))
    fwd, bwd, _ = _durations(alone, profile, loads)
    fwd, bwd = _with_action(fwd, alone), _with_action(bwd, alone)
    step = [allreduce_time(ld.param_bytes, r, wire) for ld, r in zip(loads, replicas, strict=True)]
    link = [activation_time(ld.out_bytes, 1, wire) / 2 for ld in loads]
    steady_items = 4 * (p + sum(replicas))  # the pipeline fills within about one minibatch per rank
    items = minibatches or min(steady_items, max(8, MAX_ACTIONS // (2 * p)))
    layout = pipeline(replicas)
    events, held = play(build(plan.schedule, layout, 1, items), layout, fwd, bwd, link, step=step)
    ends = sorted(e.end_s for e in events if e.stage == p - 1 and e.kind == "B")
    lo, hi = len(ends) // 4, 3 * len(ends) // 4
    per_minibatch = (ends[hi] - ends[lo]) / max(hi - lo, 1)
    return _simulation(
        plan, profile, loads, events, held, sum(replicas), per_minibatch, items, items >= steady_items
    )


def simulate(plan: Plan, profile: Profile | None = None, minibatches: int | None = None) -> Simulation:
    """Simulate ``minibatches`` minibatches (pipedream) or :data:`STEADY_MINIBATCHES` of M
    microbatches (the flushing schedules: their events are the first's, their time the steady period).

    Each device runs its actions on its own; where the devices are CPU processes sharing a host's
    cores, the time per minibatch is at least the cost model's host bound (``Prediction.host_bound_s``).
    """
    sched = model(plan.schedule)
    if profile is not None:
        profile = priced_profile(profile, plan.schedule, sched.microbatches(plan.microbatches))
    sim = _unflushed(plan, profile, minibatches) if sched.asynchronous else _flushed(plan, profile)
    host = hosts_bound(plan.cluster, plan.stages, sched.actions(plan.microbatches), plan.schedule)
    return replace(sim, time_per_minibatch_s=max(sim.time_per_minibatch_s, host))


def stage_bubbles(plan: Plan, sim: Simulation) -> tuple[float, ...]:
    """Per stage, the share of the simulated window (a flushing schedule's steady period, pipedream's
    span) its device spends not computing: waiting for an input (the peer's compute and the link's
    delay), in the flush's all-reduce or between actions, ``1 - busy / span`` with busy its F, B
    and W actions less the runtime's time per action (idle to ``run``, :func:`_computing`). Where a
    rank hosts several stages (``interleaved``, ``zbv``) the figure is the rank's, all its stages'
    actions together, the same for each; a pipedream stage's is the mean of its replicas'. The mean
    over the devices is :attr:`Simulation.bubble_fraction`. ``run`` measures the same share on each
    rank (docs/fidelity.md)."""
    span = sim.window_s or max((e.end_s for e in sim.events), default=0.0)
    busy = [0.0] * len(plan.stages)
    computed = (e for e in sim.events if e.kind != "S")
    for e, seconds in zip(computed, _computing(sim.events, plan), strict=True):
        busy[e.stage] += seconds
    sched = model(plan.schedule)
    out = []
    for s in plan.stages:
        shared = (
            [t.index for t in plan.stages if set(t.ranks) & set(s.ranks)] if sched.laid_out else [s.index]
        )
        devices = s.replicas if sched.asynchronous else 1  # (a flushing stage plays as one fast device)
        out.append(
            min(1.0, max(0.0, 1.0 - sum(busy[i] for i in shared) / (devices * span))) if span > 0 else 0.0
        )
    return tuple(out)


def with_stage_bubbles(plan: Plan, sim: Simulation) -> Plan:
    """``plan`` with each stage's simulated bubble (:func:`stage_bubbles`), as plan.json keeps it."""
    bubbles = stage_bubbles(plan, sim)
    return replace(
        plan, stages=tuple(replace(s, bubble_fraction=b) for s, b in zip(plan.stages, bubbles, strict=True))
    )


def _loads(plan: Plan, profile: Profile | None) -> list[StageLoad]:
    """The cost model's loads of the plan's stages (``price.stage_loads``; none without a profile)."""
    if profile is None:
        return [StageLoad(s.compute_s, 0.0, 0.0, 0.0, 0.0) for s in plan.stages]
    known = {n.id for n in profile.nodes}
    return stage_loads(
        profile, [[n for n in s.nodes if n in known] for s in plan.stages], plan.cluster.cores is not None
    )


def _durations(
    plan: Plan, profile: Profile | None, loads: Sequence[StageLoad]
) -> tuple[list[float], list[float], list[float]]:
    """Forward and backward time of one item per stage, and the link delay after each stage (half
    the traffic of its cut: one way)."""
    m = model(plan.schedule).microbatches(plan.microbatches)
    nodes = {n.id: n for n in profile.nodes} if profile else {}
    fwd, bwd, link = [], [], []
    wire = plan.cluster.slowest
    for stage, load in zip(plan.stages, loads, strict=True):
        total = stage.compute_s
        known = [nodes[n] for n in stage.nodes if n in nodes]
        forward = sum(n.forward_ms for n in known)  # a recomputing stage runs it twice
        f_share = forward / max(sum(n.compute_ms for n in known) + forward * stage.recompute, 1e-12)
        f_share = f_share if known else 1.0 / 3.0
        if model(plan.schedule).asynchronous:
            total = float(stage_time(total, load.param_bytes, stage.replicas, wire))
        else:
            total = microbatch_compute(total, stage.replicas, m)
        fwd.append(total * f_share)
        bwd.append(total * (1 - f_share))
        link.append(microbatch_link(load.out_bytes, stage.replicas, m, wire) / 2)
    return fwd, bwd, link


def _with_action(durations: Sequence[float], plan: Plan) -> list[float]:
    """Each stage's action durations with the runtime's own time per action (:func:`_actions_s`)."""
    return [t + o for t, o in zip(durations, _actions_s(plan), strict=True)]


def _actions_s(plan: Plan) -> list[float]:
    """Per stage, the runtime's time per action (``Cluster.action_s``) each of its simulated actions
    carries: a replicated stage of a flushing schedule plays as one server r times as fast, so 1/r
    of it; a pipedream replica runs its own. Idle time to ``run``, which times the layers' spans
    only, so not counted as computing in a bubble."""
    action, whole = plan.cluster.action_for(plan.schedule), model(plan.schedule).asynchronous
    return [action if whole else action / s.replicas for s in plan.stages]


def _memory(
    plan: Plan, profile: Profile | None, loads: Sequence[StageLoad], held: Sequence[int]
) -> tuple[int, ...]:
    """Each stage's peak with the items the simulation held, priced as the cost model does."""
    if profile is None:
        return tuple(s.memory_bytes for s in plan.stages)
    out, transient = [], []
    sched, replicas = model(plan.schedule), [s.replicas for s in plan.stages]
    for i, (stage, load, h) in enumerate(zip(plan.stages, loads, held, strict=True)):
        sync = not sched.asynchronous
        accumulates = sync and plan.microbatches > stage.replicas
        item = backward_item(not sync, plan.microbatches, stage.replicas)
        between = sched.between(i, replicas, plan.microbatches, plan.virtual_stages)
        later = min(h, sched.later(i, replicas, plan.microbatches, plan.virtual_stages))
        out.append(held_memory(load, plan.schedule, h, item, plan.optimizer, stage.recompute, accumulates,
                               item, between, stage.replicas > 1, later))  # fmt: skip
        transient.append(held_backward(load, plan.schedule, h, item, plan.optimizer, stage.recompute,
                                       accumulates, item, between, later))  # fmt: skip
    ranks = [s.ranks for s in plan.stages]
    redo = [s.recompute for s in plan.stages]
    peaks = laid_out_peaks(loads, ranks, plan.schedule, plan.microbatches, plan.optimizer, redo)
    return tuple(device_shares(out, transient, ranks, peaks))


def played(profile: Profile, plan: Plan, activation_comm: bool = True, recompute: str = "none") -> Plan:
    """``plan`` priced by the event simulation of the runtime's own lists, where its schedule's closed
    form only ranks plans (``ScheduleModel.simulated``: a slow stage stalls the ranks after it in
    every round; a message's latency overlaps what the lists let it): what the plan predicts is
    then what the simulation plays; ``extra["closed_form_s"]`` keeps what the search priced."""
    sim = simulate(plan, profile)
    period = sim.window_s  # (before the host bound)
    specs = [StageSpec(s.nodes, s.replicas, s.ranks) for s in plan.stages]
    again = assemble(
        profile, plan.cluster, specs, plan.schedule, plan.microbatches, plan.optimizer, plan.solver,
        time_override=period, extra=dict(plan.extra), activation_comm=activation_comm,
        recompute=recompute, virtual=plan.virtual_stages,
    )  # fmt: skip
    predicted = replace(again.predicted, bubble_fraction=sim.bubble_fraction)
    closed = plan.extra.get("closed_form_s", plan.predicted.time_per_minibatch_s)  # what the search saw
    return replace(
        again, predicted=predicted, extra={**again.extra, "priced_by": "simulation", "closed_form_s": closed}
    )


def write_chrome_trace(sim: Simulation, path: str | os.PathLike[str]) -> Path:
    """Chrome trace JSON (opens in Perfetto / chrome://tracing): one row per stage."""
    names = {"F": "forward", "B": "backward", "W": "weight backward", "S": "sync+step"}
    trace = [
        {"name": f"{e.kind}{e.item}", "cat": names[e.kind], "ph": "X", "pid": 0, "tid": e.stage,
         "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6}
        for e in sim.events
    ]  # fmt: skip
    trace += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": f"stage {i}"}}
        for i in range(len(sim.in_flight))
    ]
    return write_text_atomic(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}) + "\n")


def gantt(sim: Simulation, width: int = 72, until_s: float | None = None, rows: int = 24) -> list[str]:
    """A text Gantt: one row per stage; forwards are digits (item mod 10), backwards letters (W of a
    split backward in capitals), '.' idle.

    A pipeline of more than ``rows`` stages shows its first and last stages and says how many it left out.
    """
    span = until_s or max(e.end_s for e in sim.events)
    stages = len(sim.in_flight)
    shown = (
        list(range(stages)) if stages <= rows else [*range(rows * 2 // 3), *range(stages - rows // 3, stages)]
    )
    by_stage: dict[int, list[Event]] = {i: [] for i in shown}
    for e in sim.events:
        if e.stage in by_stage and e.start_s < span:
            by_stage[e.stage].append(e)
    lines: list[str] = []
    for i in shown:
        if lines and i != shown[shown.index(i) - 1] + 1:
            lines.append(f"... {i - shown[shown.index(i) - 1] - 1} stages not shown")
        cells = ["."] * width
        for e in by_stage[i]:
            a = int(e.start_s / span * width)
            b = max(a + 1, int(min(e.end_s, span) / span * width))
            mark = (
                str(e.item % 10) if e.kind == "F" else ("s" if e.kind == "S" else chr(ord("a") + e.item % 26))
            )
            mark = mark.upper() if e.kind == "W" else mark
            for c in range(a, min(b, width)):
                cells[c] = mark
        lines.append(f"stage {i:>2} |{''.join(cells)}|")
    return lines
