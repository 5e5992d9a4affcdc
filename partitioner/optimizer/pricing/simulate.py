"""Event simulation of a plan under its schedule: timeline, bubble, and peak memory per stage.

A schedule is data: each stage gets an ordered list of actions (``F`` or ``B`` of one item, an item
being a minibatch for pipedream and a microbatch for 1f1b/gpipe); one generic executor plays every
list, starting each action when the stage is free and its input (the previous stage's forward, or
the next stage's backward) has arrived. The cost model's closed forms are checked against this.

pipedream is played rank by rank from the runtime's own lists (``runtime.schedule.build_job``): a
replica runs whole minibatches at the stage's full compute time, and its stage's replicas all-reduce
once per round (PipeDream's data parallelism), so what the simulation holds in flight is what the
runtime stashes. The synchronous schedules (1f1b, gpipe, zb1p) are played per stage from the
runtime's own lists too (``runtime.schedule.build``), a replicated stage being one server r times as
fast, as their cost model prices them. zb1p's split backward takes ``1 - W_SHARE`` of a stage's
backward for B and ``W_SHARE`` for W (:data:`partitioner.optimizer.pricing.schedules.W_SHARE`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from partitioner.atomic import write_text_atomic
from partitioner.errors import PlanError
from partitioner.graph import Node, Profile, at_microbatches
from partitioner.optimizer.pricing.price import hosts_bound, stage_loads
from partitioner.optimizer.pricing.schedules import (
    W_SHARE,
    activation_time,
    allreduce_time,
    held_memory,
    pipedream_stage_time,
)
from partitioner.plan import Plan
from runtime.schedule import Action, build, build_interleaved, build_job
from runtime.schedule_zbv import build_zbv

__all__ = ["Event", "Simulation", "actions", "gantt", "play_hosted", "simulate", "write_chrome_trace"]


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
        bubble_fraction: idle share of the stages' time over the simulated span.
        peak_memory_bytes: per stage, the most bytes one device held.
        in_flight: per stage, the most items whose activations were held at once.
        minibatches: how many minibatches were simulated.
        steady: whether they reach the steady state (a very large pipedream plan is simulated over
            a shorter horizon, bounded by :data:`MAX_ACTIONS`; its time and bubble are then those of
            the pipeline filling up).
    """

    events: tuple[Event, ...]
    time_per_minibatch_s: float
    bubble_fraction: float
    peak_memory_bytes: tuple[int, ...]
    in_flight: tuple[int, ...]
    minibatches: int = 1
    steady: bool = True


MAX_ACTIONS = 100_000
"""Forwards and backwards a default pipedream simulation plays at most (about a second of Python)."""


def actions(schedule: str, stages: int, items: int) -> list[list[tuple[str, int]]]:
    """Per-stage action order: the runtime's lists of a synchronous schedule for one minibatch of
    ``items`` microbatches (GPipe all-forward-then-backward, 1F1B warm-up + steady, zb1p 1F1B with
    deferred Ws); pipedream: 1F1B over ``items`` minibatches."""
    if schedule != "pipedream":
        return [[(a.kind, a.index) for a in acts if a.kind != "S"] for acts in build(schedule, stages, items)]
    plans: list[list[tuple[str, int]]] = []
    for i in range(stages):
        if schedule == "gpipe":
            plans.append([("F", k) for k in range(items)] + [("B", k) for k in range(items)])
            continue
        warm = min(stages - i - 1, items)
        order = [("F", k) for k in range(warm)]
        for k in range(items - warm):
            order += [("F", warm + k), ("B", k)]
        order += [("B", k) for k in range(items - warm, items)]
        plans.append(order)
    return plans


def _durations(plan: Plan, profile: Profile | None) -> tuple[list[float], list[float], list[float]]:
    """Forward and backward time of one item per stage, and the link delay after each stage."""
    m = plan.microbatches if plan.schedule != "pipedream" else 1
    nodes = {n.id: n for n in profile.nodes} if profile else {}
    fwd, bwd, link = [], [], []
    out_bytes = _out_bytes(plan, nodes)
    bws = [lv.bandwidth for lv in plan.cluster.levels]
    bw = min(bws)
    for stage in plan.stages:
        total = stage.compute_s
        known = [nodes[n] for n in stage.nodes if n in nodes]
        forward = sum(n.forward_ms for n in known)  # a recomputing stage runs it twice
        f_share = forward / max(sum(n.compute_ms for n in known) + forward * stage.recompute, 1e-12)
        f_share = f_share if known else 1.0 / 3.0
        if plan.schedule == "pipedream":
            params = sum(nodes[n].param_bytes for n in stage.nodes if n in nodes)
            total = float(pipedream_stage_time(total, params, stage.replicas, bw))
        else:
            total = total / (stage.replicas * m)
        fwd.append(total * f_share)
        bwd.append(total * (1 - f_share))
        link.append(activation_time(out_bytes[stage.index], stage.replicas, bw) / 2 / m)
    return fwd, bwd, link


def _out_bytes(plan: Plan, nodes: dict[str, Node]) -> list[float]:
    """Per stage, the activation bytes crossing the cut after it: outputs of it or earlier stages read
    by a later one (an output read two stages on crosses both cuts). Linear in nodes and stages."""
    stage_of = plan.stage_of()
    crossing = [0.0] * (len(plan.stages) + 1)  # a difference array over the cuts
    last_reader: dict[str, int] = {}
    for nid, k in stage_of.items():
        for src in nodes[nid].inputs if nid in nodes else ():
            if src in stage_of and k > stage_of[src]:
                last_reader[src] = max(last_reader.get(src, 0), k)
    for src, last in last_reader.items():
        if nodes[src].op != "input":
            crossing[stage_of[src]] += nodes[src].output_bytes
            crossing[last] -= nodes[src].output_bytes
    out, running = [], 0.0
    for k in range(len(plan.stages)):
        running += crossing[k]
        out.append(running if k + 1 < len(plan.stages) and nodes else 0.0)
    return out


def _play(
    orders: list[list[tuple[str, int]]],
    fwd: list[float],
    bwd: list[float],
    link: list[float],
    wgt: list[float] | None = None,
) -> list[Event]:
    """Run every stage's list in order; an action waits for its stage and for its input. A W (time
    ``wgt``) waits only for its stage: its B came earlier in the list."""
    p = len(orders)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    events: list[Event] = []
    while any(pos[i] < len(orders[i]) for i in range(p)):
        moved = False
        for i in range(p):
            if pos[i] >= len(orders[i]):
                continue
            kind, k = orders[i][pos[i]]
            if kind == "W":
                ok, dep = True, 0.0
            elif kind == "F":
                dep = 0.0 if i == 0 else done.get(("F", i - 1, k), -1.0) + link[i - 1] * (i > 0)
                ok = i == 0 or ("F", i - 1, k) in done
            else:
                ok = ("B", i + 1, k) in done if i < p - 1 else ("F", i, k) in done
                dep = done[("B", i + 1, k)] + link[i] if i < p - 1 and ok else done.get(("F", i, k), 0.0)
            if not ok:
                continue
            start = max(free[i], dep)
            end = start + (fwd[i] if kind == "F" else bwd[i] if kind == "B" else (wgt or bwd)[i])
            done[(kind, i, k)] = end
            free[i] = end
            events.append(Event(i, kind, k, start, end))
            pos[i] += 1
            moved = True
        if not moved:
            raise PlanError("schedule deadlocks: an action waits for one that never runs")
    return events


def play_hosted(
    lists: Sequence[Sequence[Action]],
    fwd: Sequence[float],
    bwd: Sequence[float],
    link: Sequence[float],
    wgt: Sequence[float] | None = None,
) -> list[Event]:
    """Run every rank's list (``interleaved``, ``zbv``: actions of several stages each) in order; an
    action waits for its rank and its input: the previous stage's forward (``link`` of that stage
    later), or the next stage's backward (the last stage: its own forward). A W (time ``wgt``; a
    list with Ws passes ``bwd`` as the B part alone) waits only for its rank: its B came earlier in
    the list. Steps are free (no replicas).

    Event-driven as :func:`_play_ranks`: a rank runs until an action's input is missing, and is
    parked on that input until it exists, so the simulation is linear in the actions."""
    last = len(fwd) - 1
    done: dict[tuple[str, int, int], float] = {}
    free, pos = [0.0] * len(lists), [0] * len(lists)
    parked: dict[tuple[str, int, int], list[int]] = {}
    events: list[Event] = []
    ready = list(range(len(lists)))
    while ready:
        r = ready.pop()
        acts = lists[r]
        while pos[r] < len(acts):
            a, k = acts[pos[r]], acts[pos[r]].stage
            if a.kind == "W":
                start = free[r]
                free[r] = done[("W", k, a.index)] = start + (wgt or bwd)[k]
                events.append(Event(k, "W", a.index, start, free[r]))
            elif a.kind != "S":
                if a.kind == "F":
                    need, delay = ("F", k - 1, a.index), link[k - 1] if k else 0.0
                else:
                    need, delay = (("B", k + 1, a.index), link[k]) if k < last else (("F", k, a.index), 0.0)
                if need not in done and not (a.kind == "F" and k == 0):
                    parked.setdefault(need, []).append(r)
                    break
                start = max(free[r], done.get(need, 0.0) + delay)
                free[r] = done[(a.kind, k, a.index)] = start + (fwd[k] if a.kind == "F" else bwd[k])
                events.append(Event(k, a.kind, a.index, start, free[r]))
                ready.extend(parked.pop((a.kind, k, a.index), []))
            pos[r] += 1
    if any(p < len(acts) for p, acts in zip(pos, lists, strict=True)):
        raise PlanError("schedule deadlocks: an action waits for one that never runs")
    return events


def _simulate_interleaved(plan: Plan, profile: Profile | None) -> Simulation:
    """One minibatch of interleaved from the runtime's own lists (``build_interleaved``): each rank
    plays its chunks' actions in Megatron's order; no replicas, so no all-reduce."""
    v = plan.virtual_stages
    p = len(plan.stages) // v
    fwd, bwd, link = _durations(plan, profile)
    events = play_hosted(build_interleaved(p, v, plan.microbatches)[:], fwd, bwd, link)
    span = max(e.end_s for e in events)
    busy = sum(e.end_s - e.start_s for e in events)
    held = _in_flight(events, len(plan.stages))
    memory = _memory(plan, profile, held)
    bubble = 1.0 - busy / (p * span) if span > 0 else 0.0
    return Simulation(tuple(sorted(events, key=lambda e: e.start_s)), span, bubble, memory, held)


def _simulate_zbv(plan: Plan, profile: Profile | None) -> Simulation:
    """One minibatch of zbv from the runtime's own lists (``build_zbv``): each GPU plays its two
    stages of the V with the backward split by ``W_SHARE``; the hand-off at the turn of the V
    (stage ``p - 1`` to ``p``) stays on one GPU and costs no link. A stage holds a unit's graph from
    its F to its W."""
    p = len(plan.stages) // 2
    fwd, bwd, link = _durations(plan, profile)
    link[p - 1] = 0.0
    b, w = [t * (1.0 - W_SHARE) for t in bwd], [t * W_SHARE for t in bwd]
    events = play_hosted(build_zbv(p, plan.microbatches), fwd, b, link, w)
    span = max(e.end_s for e in events)
    busy = sum(e.end_s - e.start_s for e in events)
    held = _in_flight(events, len(plan.stages), "W")
    bubble = 1.0 - busy / (p * span) if span > 0 else 0.0
    return Simulation(
        tuple(sorted(events, key=lambda e: e.start_s)), span, bubble, _memory(plan, profile, held), held
    )


def _play_ranks(
    job: Sequence[Sequence[Sequence[Action]]],
    fwd: list[float],
    bwd: list[float],
    step: list[float],
    link: list[float],
) -> tuple[list[Event], list[int]]:
    """Run every rank's list in order; a step waits for all replicas of its stage and takes ``step``;
    a message after stage k arrives ``link[k]`` after it was sent. Returns the events and, per
    stage, the most minibatches one replica held between F and B.

    Event-driven: a rank runs its list until an action waits for a message (it is parked on that
    message) or for a step (parked until every replica arrives), so each action is handled once and
    the simulation is linear in the number of actions.
    """
    play = _RankPlayer(job, fwd, bwd, step, link)
    ready = [(k, r) for k, ranks in enumerate(job) for r in range(len(ranks))]
    while ready:
        ready.extend(play.advance(*ready.pop()))
    if play.left:
        raise PlanError("schedule deadlocks: an action waits for one that never runs")
    return play.events, play.held


class _RankPlayer:
    """The state of :func:`_play_ranks`: when each action ended, what each rank waits for."""

    def __init__(
        self,
        job: Sequence[Sequence[Sequence[Action]]],
        fwd: list[float],
        bwd: list[float],
        step: list[float],
        link: list[float],
    ) -> None:
        self.job, self.fwd, self.bwd, self.step, self.link = job, fwd, bwd, step, link
        self.done: dict[tuple[str, int, int], float] = {}
        self.free = [[0.0] * len(ranks) for ranks in job]
        self.pos = [[0] * len(ranks) for ranks in job]
        self.held = [0] * len(job)
        self.live = [[0] * len(ranks) for ranks in job]
        self.parked: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
        self.at_step: list[list[int]] = [[] for _ in job]
        self.events: list[Event] = []
        self.left = sum(len(a) for ranks in job for a in ranks)

    def advance(self, k: int, r: int) -> list[tuple[int, int]]:
        """Run rank (k, r) as far as it can; the ranks its actions woke up."""
        woken: list[tuple[int, int]] = []
        acts = self.job[k][r]
        while self.pos[k][r] < len(acts):
            a = acts[self.pos[k][r]]
            if a.kind == "S":
                self.at_step[k].append(r)
                if len(self.at_step[k]) == len(self.job[k]):
                    woken += self._step(k, a.index)
                return woken
            first = (a.kind == "F" and k == 0) or (a.kind == "B" and k == len(self.job) - 1)
            need = ("F", k - 1, a.index) if a.kind == "F" else ("B", k + 1, a.index)
            if not first and need not in self.done:
                self.parked.setdefault(need, []).append((k, r))
                return woken
            self._run(k, r, a, first, need)
            woken += self.parked.pop((a.kind, k, a.index), [])
        return woken

    def _run(self, k: int, r: int, a: Action, first: bool, need: tuple[str, int, int]) -> None:
        if first:
            ready = 0.0 if a.kind == "F" else self.done.get(("F", k, a.index), 0.0)
        else:
            ready = self.done[need] + (self.link[k - 1] if a.kind == "F" else self.link[k])
        start = max(self.free[k][r], ready)
        end = start + (self.fwd[k] if a.kind == "F" else self.bwd[k])
        self.done[(a.kind, k, a.index)] = self.free[k][r] = end
        self.events.append(Event(k, a.kind, a.index, start, end))
        self.live[k][r] += 1 if a.kind == "F" else -1
        self.held[k] = max(self.held[k], self.live[k][r])
        self.pos[k][r] += 1
        self.left -= 1

    def _step(self, k: int, index: int) -> list[tuple[int, int]]:
        start = max(self.free[k])
        self.events.append(Event(k, "S", index, start, start + self.step[k]))
        self.free[k] = [start + self.step[k]] * len(self.job[k])
        self.pos[k] = [i + 1 for i in self.pos[k]]
        self.left -= len(self.job[k])
        woken, self.at_step[k] = [(k, r) for r in self.at_step[k]], []
        return woken


def _simulate_pipedream(plan: Plan, profile: Profile | None, minibatches: int | None) -> Simulation:
    """Every rank of a pipedream plan from the runtime's lists: a replica's minibatch takes the stage's
    whole compute, its round's all-reduce PipeDream's 4(r-1)P/(rB)."""
    replicas = [s.replicas for s in plan.stages]
    p, bw = len(replicas), min(lv.bandwidth for lv in plan.cluster.levels)
    fwd, bwd, _ = _durations(
        replace(plan, stages=tuple(replace(s, replicas=1) for s in plan.stages)), profile
    )
    params = _params(plan, profile)
    step = [allreduce_time(params[k], r, bw) for k, r in enumerate(replicas)]
    link = [activation_time(out, 1, bw) / 2 for out in _out_bytes(plan, _nodes(profile))]
    steady_items = 4 * (p + sum(replicas))  # the pipeline fills within about one minibatch per rank
    items = minibatches or min(steady_items, max(8, MAX_ACTIONS // (2 * p)))
    events, held = _play_ranks(build_job("pipedream", replicas, 1, items), fwd, bwd, step, link)
    ends = sorted(e.end_s for e in events if e.stage == p - 1 and e.kind == "B")
    lo, hi = len(ends) // 4, 3 * len(ends) // 4
    per_minibatch = (ends[hi] - ends[lo]) / max(hi - lo, 1)
    span = max(e.end_s for e in events)
    busy = sum(e.end_s - e.start_s for e in events if e.kind != "S")
    bubble = 1.0 - busy / (sum(replicas) * span) if span > 0 else 0.0
    memory = _memory(plan, profile, held)
    return Simulation(
        tuple(sorted(events, key=lambda e: e.start_s)),
        per_minibatch,
        bubble,
        memory,
        tuple(held),
        items,
        items >= steady_items,
    )


def _nodes(profile: Profile | None) -> dict[str, Node]:
    return {n.id: n for n in profile.nodes} if profile else {}


def simulate(plan: Plan, profile: Profile | None = None, minibatches: int | None = None) -> Simulation:
    """Simulate ``minibatches`` minibatches (pipedream) or one minibatch of M microbatches (1f1b, gpipe).

    Each device runs its actions on its own; where the devices are CPU processes sharing a host's
    cores, the time per minibatch is at least the cost model's host bound (``Prediction.host_bound_s``).
    """
    if profile is not None:
        profile = at_microbatches(profile, 1 if plan.schedule == "pipedream" else plan.microbatches)
    sim = _simulate_devices(plan, profile, minibatches)
    host = hosts_bound(plan.cluster, plan.stages)
    return replace(sim, time_per_minibatch_s=max(sim.time_per_minibatch_s, host))


def _simulate_devices(plan: Plan, profile: Profile | None, minibatches: int | None) -> Simulation:
    if plan.schedule == "pipedream":
        return _simulate_pipedream(plan, profile, minibatches)
    if plan.schedule == "interleaved":
        return _simulate_interleaved(plan, profile)
    if plan.schedule == "zbv":
        return _simulate_zbv(plan, profile)
    p = len(plan.stages)
    fwd, bwd, link = _durations(plan, profile)
    sync = plan.schedule != "pipedream"
    items = plan.microbatches if sync else (minibatches or 4 * p + 4)
    wgt = None
    if plan.schedule == "zb1p":
        bwd, wgt = [t * (1.0 - W_SHARE) for t in bwd], [t * W_SHARE for t in bwd]
    events = _play(actions(plan.schedule, p, items), fwd, bwd, link, wgt)
    end = max(e.end_s for e in events)
    if sync:
        bws = min(lv.bandwidth for lv in plan.cluster.levels)
        params = _params(plan, profile)
        step = max(allreduce_time(params[s.index], s.replicas, bws)
                   for s in plan.stages)  # fmt: skip
        events += [Event(i, "S", 0, end, end + step) for i in range(p)]
        per_minibatch = end + step
    else:
        first = sorted(e.end_s for e in events if e.stage == 0 and e.kind == "B")
        lo, hi = min(p, len(first) - 1), max(len(first) - 1 - p, 0)  # skip warm-up and drain
        lo, hi = (lo, hi) if hi > lo else (0, len(first) - 1)
        per_minibatch = (first[hi] - first[lo]) / max(hi - lo, 1)
    span = max(e.end_s for e in events)
    busy = sum(e.end_s - e.start_s for e in events if e.kind != "S")
    bubble = 1.0 - busy / (p * span) if span > 0 else 0.0
    held = _in_flight(events, p, "W" if plan.schedule == "zb1p" else "B")
    memory = _memory(plan, profile, held)
    return Simulation(tuple(sorted(events, key=lambda e: e.start_s)), per_minibatch, bubble, memory, held)


def _params(plan: Plan, profile: Profile | None) -> list[float]:
    """Parameter bytes per stage (0 without a profile)."""
    nodes = _nodes(profile)
    return [float(sum(nodes[n].param_bytes for n in s.nodes if n in nodes)) for s in plan.stages]


def _in_flight(events: Sequence[Event], p: int, release: str = "B") -> tuple[int, ...]:
    """Per stage, the most items whose graphs were held at once: from their F's end to the end of
    the ``release`` that frees them (B, or W for a split backward)."""
    peak = [0] * p
    for i in range(p):
        marks = sorted(
            [(e.end_s, 1) for e in events if e.stage == i and e.kind == "F"]
            + [(e.end_s, -1) for e in events if e.stage == i and e.kind == release]
        )
        level = 0
        for _, delta in marks:
            level += delta
            peak[i] = max(peak[i], level)
    return tuple(peak)


def _memory(plan: Plan, profile: Profile | None, held: Sequence[int]) -> tuple[int, ...]:
    """Each stage's peak with the items the simulation held, priced as the cost model does."""
    if profile is None:
        return tuple(s.memory_bytes for s in plan.stages)
    known = {n.id for n in profile.nodes}
    loads = stage_loads(profile, [[n for n in s.nodes if n in known] for s in plan.stages])
    out = []
    for stage, load, h in zip(plan.stages, loads, held, strict=True):
        sync = plan.schedule != "pipedream"
        share = plan.microbatches * stage.replicas if sync else 1
        accumulates = sync and plan.microbatches > stage.replicas
        out.append(held_memory(load, plan.schedule, h, share, plan.optimizer, stage.recompute, accumulates))
    return tuple(out)


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
