"""``--schedule auto``: the fastest predicted plan over schedules x microbatch counts x virtual stages
(x recomputation, with ``recompute="auto"``).

Each schedule has its own exact search (:func:`partitioner.optimizer.solve_with`) of cuts,
replicas and recomputation under the memory limit; ``auto`` runs it for every schedule at every
microbatch count it considers (interleaved also at every virtual stage count) and keeps the plan
with the least predicted time per minibatch, so it is never predicted slower than the best fixed
schedule it considers.

Microbatch counts are searched only where the profile measured each layer's fixed time per call
(``pipeplan profile`` does by default): then more microbatches shrink the bubble but pay every
layer's fixed time once more each, and the counts trade one against the other. A profile without
fixed times prices a microbatch as its share of the samples, so more would always look faster:
there the count stays the one asked. Pure Python, no torch.

Example:
    >>> choice = solve_auto(profile, Cluster.flat(8), SolveOptions(microbatches=4))  # doctest: +SKIP
    >>> choice.plan.schedule, choice.times
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile
from partitioner.optimizer.options import SolveOptions
from partitioner.plan import SCHEDULES, Cluster, Plan

__all__ = [
    "AUTO_SCHEDULES",
    "AUTO_VIRTUAL_STAGES",
    "LAID_OUT",
    "AutoChoice",
    "fastest_interleaved",
    "microbatch_counts",
    "solve_auto",
]

#: what ``auto`` tries by default: every priced schedule.
AUTO_SCHEDULES: tuple[str, ...] = SCHEDULES

#: schedules with a fixed number of stages per GPU (interleaved's virtual stages, zbv's V of two):
#: a model with too few layers, or microbatches their order cannot play, has no plan of theirs, which
#: ``auto`` shows as None rather than an error.
LAID_OUT = ("interleaved", "zbv")

#: the virtual stages per GPU ``auto`` tries for ``interleaved``, keeping the fastest. A count
#: applies where the microbatches are a multiple of the GPUs and the model has at least GPUs x the
#: count layers; where none applies, interleaved's time is None.
AUTO_VIRTUAL_STAGES: tuple[int, ...] = (2, 3, 4)

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
    """``opts.schedule``'s fastest plan over ``counts`` (None: interleaved applies at none).

    Raises:
        InfeasibleError: nothing fits at any count (the first count's message).
    """
    from partitioner.optimizer import solve_with

    best: Plan | None = None
    error: InfeasibleError | None = None
    for m in (1,) if opts.schedule == "pipedream" else counts:
        at = replace(opts, microbatches=m, virtual_stages=1).checked(profile)

        def one(virtual: int, at: SolveOptions = at) -> Plan:
            return solve_with(profile, cluster, replace(at, virtual_stages=virtual).checked(profile))

        try:
            plan = fastest_interleaved(one) if opts.schedule == "interleaved" else one(1)
        except InfeasibleError as exc:
            error = error or exc
            continue
        except PlanError:
            if opts.schedule not in LAID_OUT:
                raise
            continue
        if plan is not None and (best is None or _time(plan) < _time(best)):
            best = plan
    if best is None and error is not None:
        raise error
    return best


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
        if best is None or _time(plan) < _time(best):
            best = plan
    if best is None and error is not None:
        raise error
    return best
