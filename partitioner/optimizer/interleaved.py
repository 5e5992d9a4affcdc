"""Plans for ``interleaved`` (Megatron's virtual stages): ``gpus * v`` one-device stages, stage ``s``
on rank ``s mod gpus``.

A first version, not an exact search: the cuts come from candidates ranked by interleaved's closed
form (:func:`partitioner.optimizer.pricing.schedules.interleaved_time`, a lower bound on unequal stages); the
:data:`SIMULATED` best that fit memory are priced by the event simulation of the runtime's lists
(:func:`played`), and the fastest wins, so a plan predicts what the simulation plays. The
candidates are the exact straight 1f1b search over ``gpus * v`` devices (balanced stages, which
interleaved also wants: its time is driven by each rank's sum of chunks and the slowest stage),
when it uses all of them, and the contiguous splits of the layers' topological order: every one
where they are few (:data:`EVERY_SPLIT_MAX`), else torchgpipe's time-balanced split hill-climbed
one layer at a time under the closed form. An exact search over every downset would price the
rank sums inside the DP; it does not exist yet.

``zbv`` (:mod:`runtime.schedule_zbv`) is planned the same way (:func:`solve_interleaved` with
``schedule="zbv"``): ``2 gpus`` stages laid out as a V (:func:`layout_specs`), ranked by its closed
form (:func:`partitioner.optimizer.zbv.zbv_time`) and priced by the simulation of its lists.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import combinations, pairwise

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile
from partitioner.optimizer.pricing.price import StageSpec, assemble
from partitioner.optimizer.search.candidates import balanced_cuts
from partitioner.plan import Cluster, Plan, SolverInfo
from runtime.schedule import ScheduleError, check_interleaved
from runtime.schedule_zbv import check_zbv, zbv_placement

__all__ = [
    "REFINE_PRICINGS",
    "SIMULATED",
    "check_layout",
    "check_virtual",
    "interleaved_specs",
    "layout_specs",
    "played",
    "solve_interleaved",
]

REFINE_PRICINGS = 200
"""Plans the hill climb from the time-balanced cuts prices at most (about a millisecond each on a
hundred-layer profile)."""

SIMULATED = 8
"""The candidates with the lowest closed-form bound that the event simulation then prices; the fastest
simulated one wins."""

EVERY_SPLIT_MAX = 300
"""Up to this many contiguous splits of the layers' order, every one is priced instead of the climb:
the best contiguous split (on random 5-9 layer chains the climb is 1.04x it at the median, 1.13x at
worst; the plain time-balanced split 1.09x and 1.38x)."""


def check_virtual(gpus: int, virtual: int, microbatches: int) -> None:
    """What the runtime can play: at least 2 GPUs (a rank does not send to itself) and
    ``microbatches`` a multiple of ``gpus`` when ``virtual`` > 1."""
    if virtual > 1 and gpus < 2:
        raise PlanError("--schedule interleaved with --virtual-stages > 1 needs at least 2 GPUs")
    try:
        check_interleaved(gpus, virtual, microbatches)
    except ScheduleError as exc:
        raise PlanError(str(exc)) from exc


def interleaved_specs(groups: Sequence[Sequence[str]], gpus: int) -> list[StageSpec]:
    """Stage ``s`` (its node ids) on rank ``s mod gpus``, one device each."""
    return [StageSpec(tuple(nodes), 1, (s % gpus,)) for s, nodes in enumerate(groups)]


def layout_specs(schedule: str, groups: Sequence[Sequence[str]], gpus: int) -> list[StageSpec]:
    """The stages of ``schedule`` on their ranks: interleaved's cycle, or zbv's V (stages ``r`` and
    ``2 gpus - 1 - r`` on rank ``r``)."""
    if schedule != "zbv":
        return interleaved_specs(groups, gpus)
    homes = zbv_placement(gpus)
    return [StageSpec(tuple(nodes), 1, (homes[s],)) for s, nodes in enumerate(groups)]


def check_layout(schedule: str, gpus: int, virtual: int, microbatches: int) -> None:
    """What the runtime can play, per schedule (zbv: any microbatch count on any GPUs)."""
    if schedule != "zbv":
        check_virtual(gpus, virtual, microbatches)
        return
    try:
        check_zbv(gpus, microbatches)
    except ScheduleError as exc:
        raise PlanError(str(exc)) from exc


def _time_balanced(profile: Profile, parts: int) -> list[int]:
    """Bounds of ``parts`` contiguous slices of the layers' topological order with balanced compute."""
    return balanced_cuts([n.compute_ms for n in profile.layers], parts)


def _groups(profile: Profile, bounds: Sequence[int]) -> list[tuple[str, ...]]:
    """The slices ``bounds`` cut the layers into, the inputs on the first and the output marker on
    the last (a slice of a topological order only reads earlier slices)."""
    layers = list(profile.layers)
    groups = [tuple(n.id for n in layers[a:b]) for a, b in pairwise(bounds)]
    inputs = tuple(n.id for n in profile.nodes if n.op == "input")
    outputs = tuple(n.id for n in profile.nodes if n.op == "output")
    groups[-1] += outputs
    return [inputs + groups[0], *groups[1:]]


def _refined(bounds: list[int], price: Callable[[list[int]], Plan | None], budget: int) -> Plan | None:
    """Hill-climb the inner bounds one layer at a time while the priced time falls, at most
    ``budget`` pricings: interleaved's time is set by each GPU's sum of chunks and the slowest stage,
    which a split balanced stage by stage (and blind to cut traffic) need not minimise."""
    best = price(bounds)
    if best is None:
        return None
    spent, moved = 1, True
    while moved and spent < budget:
        moved = False
        for i in range(1, len(bounds) - 1):
            for step in (-1, 1):
                trial = [*bounds[:i], bounds[i] + step, *bounds[i + 1 :]]
                if not trial[i - 1] < trial[i] < trial[i + 1] or spent >= budget:
                    continue
                spent += 1
                plan = price(trial)
                if (
                    plan is not None
                    and plan.predicted.time_per_minibatch_s < best.predicted.time_per_minibatch_s
                ):
                    best, bounds, moved = plan, trial, True
    return best


def solve_interleaved(
    profile: Profile,
    cluster: Cluster,
    microbatches: int,
    optimizer: str,
    virtual: int,
    straight: Callable[[Cluster], Plan],
    activation_comm: bool = True,
    recompute: str = "none",
    schedule: str = "interleaved",
) -> Plan:
    """The fastest interleaved (or, ``schedule="zbv"`` with ``virtual`` 2, zbv) plan among the
    candidate cuts that fits ``cluster``'s memory.

    ``straight(wide)``: the exact straight 1f1b plan on ``wide`` (``gpus * virtual`` devices).

    Raises:
        PlanError: too few layers for ``gpus * virtual`` stages, or microbatches the order cannot play.
        InfeasibleError: no candidate fits.
    """
    p, parts = cluster.gpus, cluster.gpus * virtual
    check_layout(schedule, p, virtual, microbatches)
    if len(profile.layers) < parts:
        what = "--schedule zbv" if schedule == "zbv" else f"--virtual-stages {virtual}"
        raise PlanError(f"{what} on {p} GPUs needs {parts} stages, the model has "
                        f"{len(profile.layers)} layers")  # fmt: skip
    errors: list[InfeasibleError] = []

    def price(name: str, groups: Sequence[Sequence[str]]) -> Plan | None:
        info = SolverInfo(f"{schedule} ({name} cuts)", 0.0, False)
        try:
            return assemble(profile, cluster, layout_specs(schedule, groups, p), schedule, microbatches,
                            optimizer, info, activation_comm=activation_comm, recompute=recompute,
                            virtual=virtual)  # fmt: skip
        except InfeasibleError as exc:
            errors.append(exc)
            return None

    wide = Cluster.flat(parts, min(lv.bandwidth for lv in cluster.levels))

    def sliced(bounds: list[int]) -> Plan | None:
        return price("time-balanced, refined", _groups(profile, bounds))

    n = len(profile.layers)
    if math.comb(n - 1, parts - 1) <= EVERY_SPLIT_MAX:
        found = [price("every contiguous split", _groups(profile, [0, *cuts, n])) for cuts in
                 combinations(range(1, n), parts - 1)]  # fmt: skip
    else:
        found = [_refined(_time_balanced(profile, parts), sliced, REFINE_PRICINGS)]
    try:
        one = straight(wide)
        if len(one.stages) == parts:
            found.append(price("straight 1f1b", [s.nodes for s in one.stages]))
    except InfeasibleError:
        pass
    plans = sorted(
        (plan for plan in found if plan is not None), key=lambda plan: plan.predicted.time_per_minibatch_s
    )
    if not plans:
        raise errors[0] if errors else InfeasibleError(f"no {schedule} plan fits")
    simulated = [played(profile, plan, activation_comm, recompute) for plan in plans[:SIMULATED]]
    return min(simulated, key=lambda plan: plan.predicted.time_per_minibatch_s)


def played(profile: Profile, plan: Plan, activation_comm: bool = True, recompute: str = "none") -> Plan:
    """``plan`` priced by the event simulation of the runtime's own lists (``simulate``), which the
    closed form only bounds from below on unequal stages (a slow stage stalls the ranks after it in
    every round): what the plan predicts is then what the simulation plays."""
    from partitioner.optimizer.pricing.simulate import simulate

    sim = simulate(plan, profile)
    span = max((e.end_s for e in sim.events), default=0.0)  # (one minibatch from 0; no host bound)
    specs = [StageSpec(s.nodes, s.replicas, s.ranks) for s in plan.stages]
    again = assemble(
        profile, plan.cluster, specs, plan.schedule, plan.microbatches, plan.optimizer, plan.solver,
        time_override=span, extra=dict(plan.extra), activation_comm=activation_comm,
        recompute=recompute, virtual=plan.virtual_stages,
    )  # fmt: skip
    predicted = replace(again.predicted, bubble_fraction=sim.bubble_fraction)
    return replace(again, predicted=predicted, extra={**again.extra, "priced_by": "simulation"})
