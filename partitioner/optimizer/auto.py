"""``--schedule auto``: the fastest predicted plan over schedules x microbatch counts x virtual stages
(x recomputation), so never predicted slower than the best fixed one it considers (microbatch
counts only where the profile measured fixed times per call: docs/optimizer-search.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile
from partitioner.optimizer.options import SolveOptions
from partitioner.optimizer.planner import solve_with
from partitioner.optimizer.pricing.schedules import MODELS, model
from partitioner.plan import Cluster, Plan

__all__ = ["AUTO_SCHEDULES", "AutoChoice", "microbatch_counts", "solve_auto"]

#: what ``auto`` tries by default: every priced schedule. One that lays several stages on each GPU
#: has no plan on a model with too few layers, or microbatches its order cannot play: ``auto``
#: shows it as None rather than an error. Each is tried at every virtual stage count its model
#: lists (``ScheduleModel.auto_virtual``), the fastest kept.
AUTO_SCHEDULES: tuple[str, ...] = tuple(MODELS)

#: the most microbatches ``auto`` tries, per GPU: past a few per stage the bubble is small and
#: every further microbatch only adds fixed costs.
MICROBATCHES_PER_GPU = 4


@dataclass(frozen=True)
class AutoChoice:
    """The chosen plan and what every schedule predicted (None: nothing fits its memory model).

    Attributes:
        plan: the fastest plan; its ``extra["schedule_auto"]`` holds ``times`` too.
        times: per schedule, the predicted seconds per minibatch of its best plan.
        plans: per schedule, that plan (None where nothing fits).
        counts: the microbatch counts searched (one: the asked count, where the profile has no
            fixed times).
    """

    plan: Plan
    times: dict[str, float | None]
    plans: dict[str, Plan | None]
    counts: tuple[int, ...] = ()


def microbatch_counts(profile: Profile, gpus: int, asked: int) -> tuple[int, ...]:
    """The microbatch counts to search: powers of two that split the batch evenly, up to
    :data:`MICROBATCHES_PER_GPU` per GPU, and ``asked``; just ``asked`` where the profile measured
    no fixed times or does not say its batch size."""
    batch = profile.batch_size
    if not batch or not any(n.forward_fixed_ms or n.backward_fixed_ms for n in profile.nodes):
        return (asked,)
    top = min(batch, MICROBATCHES_PER_GPU * max(gpus, 1))
    powers = {1 << k for k in range(top.bit_length()) if (1 << k) <= top and batch % (1 << k) == 0}
    return tuple(sorted(powers | {asked}))


def solve_auto(
    profile: Profile,
    cluster: Cluster,
    opts: SolveOptions,
    schedules: Sequence[str] = AUTO_SCHEDULES,
    counts: Sequence[int] | None = None,
) -> AutoChoice:
    """The best plan of each of ``schedules`` over ``counts`` microbatches, and the fastest of them.

    ``opts`` carries the optimizer, solver, recompute mode and the rest (its schedule and virtual
    stages are what this varies); ``counts``: default :func:`microbatch_counts` of
    ``opts.microbatches``. ``pipedream`` runs whole minibatches, so it has one count.

    Raises:
        InfeasibleError: no schedule fits (the first schedule's message, naming the memory that would).
        PlanError: bad optimizer, solver or recompute mode, or a count below 1.
    """
    counts = tuple(counts or microbatch_counts(profile, cluster.gpus, opts.microbatches))
    plans: dict[str, Plan | None] = {}
    first_error: InfeasibleError | None = None
    for schedule in schedules:
        try:
            plans[schedule] = _best_schedule(profile, cluster, replace(opts, schedule=schedule), counts)
        except InfeasibleError as exc:
            plans[schedule], first_error = None, first_error or exc
    found = {name: plan for name, plan in plans.items() if plan is not None}
    if not found:
        assert first_error is not None
        raise first_error
    best = min(found.values(), key=_time)
    times = {name: _time(p) if p else None for name, p in plans.items()}
    best = replace(best, extra={**best.extra, "schedule_auto": times, "microbatches_searched": list(counts)})
    return AutoChoice(best, times, plans, counts)


def _time(plan: Plan) -> float:
    return plan.predicted.time_per_minibatch_s


def _best_schedule(
    profile: Profile, cluster: Cluster, opts: SolveOptions, counts: Sequence[int]
) -> Plan | None:
    """``opts.schedule``'s fastest plan over ``counts`` and its model's virtual stage counts (None: a
    laid-out schedule applies at none: a PlanError on microbatches or layers).

    Raises:
        InfeasibleError: nothing fits at any count (the first one's message).
    """
    sched = model(opts.schedule)
    best: Plan | None = None
    error: InfeasibleError | None = None
    for m in (1,) if sched.asynchronous else counts:
        at = replace(opts, microbatches=m, virtual_stages=1).checked(profile)
        for virtual in sched.auto_virtual:
            try:
                plan = solve_with(profile, cluster, replace(at, virtual_stages=virtual).checked(profile))
            except InfeasibleError as exc:
                error = error or exc
                continue
            except PlanError:
                if not sched.laid_out:
                    raise
                continue
            if best is None or _time(plan) < _time(best):
                best = plan
    if best is None and error is not None:
        raise error
    return best
