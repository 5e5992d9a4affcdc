"""``--schedule auto``: the fastest predicted plan over every schedule the planner prices.

Each schedule has its own exact search (:func:`partitioner.optimizer.solve`); ``auto`` runs each under
the same cluster, memory limit, optimizer and recompute mode and keeps the plan with the least
predicted time per minibatch, so it is never predicted slower than the best fixed schedule it
considers. The synchronous schedules use the asked microbatch count (the cost model scales a
minibatch's profiled time linearly to microbatches, so it would always ask for more: the count stays
the user's choice); ``pipedream`` runs whole minibatches. Pure Python, no torch.

Example:
    >>> choice = solve_auto(profile, Cluster.flat(8), microbatches=4)  # doctest: +SKIP
    >>> choice.plan.schedule, choice.times
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile
from partitioner.plan import SCHEDULES, Cluster, Plan

__all__ = ["AUTO_SCHEDULES", "AUTO_VIRTUAL_STAGES", "AutoChoice", "fastest_interleaved", "solve_auto"]

#: what ``auto`` tries by default: every priced schedule but zbv (not yet among auto's candidates).
AUTO_SCHEDULES: tuple[str, ...] = tuple(s for s in SCHEDULES if s != "zbv")

#: the virtual stages per GPU ``auto`` tries for ``interleaved``, keeping the fastest. A count
#: applies where the microbatches are a multiple of the GPUs and the model has at least GPUs x the
#: count layers; where none applies, interleaved's time is None.
AUTO_VIRTUAL_STAGES: tuple[int, ...] = (2, 3, 4)


@dataclass(frozen=True)
class AutoChoice:
    """The chosen plan and what every schedule predicted (None: nothing fits its memory model).

    Attributes:
        plan: the fastest plan; its ``extra["schedule_auto"]`` holds ``times`` too.
        times: per schedule, the predicted seconds per minibatch of its best plan.
        plans: per schedule, that plan (None where nothing fits).
    """

    plan: Plan
    times: dict[str, float | None]
    plans: dict[str, Plan | None]


def solve_auto(
    profile: Profile,
    cluster: Cluster,
    microbatches: int = 4,
    optimizer: str = "sgd",
    straight: bool = False,
    solver: str = "dp",
    activation_comm: bool = True,
    recompute: str = "none",
    schedules: Sequence[str] = AUTO_SCHEDULES,
) -> AutoChoice:
    """The best plan of each of ``schedules``, and the fastest of them.

    Raises:
        InfeasibleError: no schedule fits (the first schedule's message, naming the memory that would).
        PlanError: bad microbatch count, optimizer, solver or recompute mode.
    """
    from partitioner.optimizer import solve

    plans: dict[str, Plan | None] = {}
    first_error: InfeasibleError | None = None
    for schedule in schedules:
        m = 1 if schedule == "pipedream" else microbatches

        def one(virtual: int, schedule: str = schedule, m: int = m) -> Plan:
            return solve(
                profile,
                cluster,
                schedule,
                m,
                optimizer,
                straight,
                solver,
                activation_comm,
                recompute,
                virtual,
            )

        try:
            plans[schedule] = fastest_interleaved(one) if schedule == "interleaved" else one(1)
        except InfeasibleError as exc:
            plans[schedule], first_error = None, first_error or exc
    found = {name: plan for name, plan in plans.items() if plan is not None}
    if not found:
        assert first_error is not None
        raise first_error
    best = min(found.values(), key=lambda p: p.predicted.time_per_minibatch_s)
    times = {name: p.predicted.time_per_minibatch_s if p else None for name, p in plans.items()}
    best = replace(best, extra={**best.extra, "schedule_auto": times})
    return AutoChoice(best, times, plans)


def fastest_interleaved(solve_at: Callable[[int], Plan]) -> Plan | None:
    """The fastest of ``solve_at(v)`` over :data:`AUTO_VIRTUAL_STAGES`; None where no count applies
    (a PlanError: microbatches or layers).

    Raises:
        InfeasibleError: some count applies but none fits memory (the first one's message).
    """
    best: Plan | None = None
    error: InfeasibleError | None = None
    for virtual in AUTO_VIRTUAL_STAGES:
        try:
            plan = solve_at(virtual)
        except InfeasibleError as exc:
            error = error or exc
            continue
        except PlanError:
            continue
        if best is None or plan.predicted.time_per_minibatch_s < best.predicted.time_per_minibatch_s:
            best = plan
    if best is None and error is not None:
        raise error
    return best
