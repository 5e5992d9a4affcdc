"""Plans for the schedules that lay several one-device stages on each GPU (``ScheduleModel.laid_out``):
candidate cuts ranked by the closed form, the best priced by the simulation; not an exact search
(docs/optimizer-search.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import combinations, pairwise

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile
from partitioner.optimizer.pricing.price import StageSpec, assemble
from partitioner.optimizer.pricing.schedules import model
from partitioner.optimizer.pricing.simulate import played
from partitioner.optimizer.search.candidates import balanced_cuts
from partitioner.plan import Cluster, Plan, SolverInfo
from runtime.schedule import ScheduleError

__all__ = [
    "EVERY_SPLIT_MAX",
    "REFINE_PRICINGS",
    "SIMULATED",
    "check_layout",
    "layout_specs",
    "solve_laid_out",
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


def layout_specs(schedule: str, groups: Sequence[Sequence[str]], gpus: int) -> list[StageSpec]:
    """The stages (their node ids) on the GPUs the schedule lays them on, one device each."""
    placement = model(schedule).runtime.placement
    assert placement is not None, f"{schedule} does not lay out its stages"
    homes = placement(gpus, len(groups) // gpus)
    return [StageSpec(tuple(nodes), 1, homes[s]) for s, nodes in enumerate(groups)]


def check_layout(schedule: str, gpus: int, virtual: int, microbatches: int) -> None:
    """What the runtime can play (``runtime.schedule.Schedule.check``), as a PlanError."""
    try:
        model(schedule).runtime.check(gpus, virtual, microbatches)
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


def solve_laid_out(
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
    """The fastest plan of ``schedule`` with ``virtual`` stages per GPU among the candidate cuts that
    fits ``cluster``'s memory.

    ``straight(wide)``: the exact straight plan of the model's ``seed_schedule`` on ``wide``
    (``gpus * virtual`` devices).

    Raises:
        PlanError: too few layers for ``gpus * virtual`` stages, or microbatches the order cannot play.
        InfeasibleError: no candidate fits.
    """
    p, parts = cluster.gpus, cluster.gpus * virtual
    check_layout(schedule, p, virtual, microbatches)
    if len(profile.layers) < parts:
        what = (
            f"--virtual-stages {virtual}"
            if model(schedule).virtual_stages is None
            else f"--schedule {schedule}"
        )
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

    wide = Cluster.flat(parts, cluster.slowest)

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
            found.append(price(f"straight {model(schedule).seed_schedule}", [s.nodes for s in one.stages]))
    except InfeasibleError:
        pass
    plans = sorted(
        (plan for plan in found if plan is not None), key=lambda plan: plan.predicted.time_per_minibatch_s
    )
    if not plans:
        raise errors[0] if errors else InfeasibleError(f"no {schedule} plan fits")
    simulated = [played(profile, plan, activation_comm, recompute) for plan in plans[:SIMULATED]]
    return min(simulated, key=lambda plan: plan.predicted.time_per_minibatch_s)
