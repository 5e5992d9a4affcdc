"""Whether the plans a summary compares against could run at all: a speedup over a plan that does
not fit in memory is no fact, and tied schedules need a word on why the chosen one won."""

from __future__ import annotations

from partitioner.errors import InfeasibleError
from partitioner.graph import Profile
from partitioner.optimizer.auto import AutoChoice
from partitioner.optimizer.pricing.schedules import model, priced_profile
from partitioner.optimizer.search.candidates import data_parallel
from partitioner.plan import Plan

__all__ = ["auto_tie", "data_parallel_fits"]


def data_parallel_fits(profile: Profile, plan: Plan) -> bool:
    """Whether one stage replicated on every device of ``plan``'s cluster fits its memory, at the plan's
    schedule, microbatches and optimizer (the comparator the plan's speedup is computed against)."""
    if plan.cluster.memory_bytes is None:
        return True
    at = priced_profile(profile, plan.schedule, model(plan.schedule).microbatches(plan.microbatches))
    try:
        data_parallel(at, plan.cluster, plan.schedule, plan.microbatches, plan.optimizer)
    except InfeasibleError:
        return False
    return True


def auto_tie(choice: AutoChoice) -> str | None:
    """A sentence for ``--schedule auto``'s table when several schedules predict the chosen plan's time
    (to 0.1%): which, why they tie (the host's cores bound them all, or no schedule's order helps
    these stages), and why the chosen one won; None when the chosen plan stands alone."""
    best = choice.times[choice.plan.schedule] or 0.0
    tied = {
        name: plan
        for name, plan in choice.plans.items()
        if plan is not None and (choice.times[name] or 0.0) <= best * 1.001
    }
    if len(tied) < 2:
        return None
    hosts = all(
        p.predicted.host_bound_s and p.predicted.host_bound_s >= (p.predicted.pipeline_s or 0)
        for p in tied.values()
    )
    why = (
        "the host's cores bound each of them (their compute, not the pipeline, sets the time)"
        if hosts
        else "no schedule's order makes these stages faster than another's"
    )
    chosen = choice.plan.schedule
    names = list(choice.plans)
    earlier = [n for n in tied if names.index(n) < names.index(chosen)]
    if earlier:
        gap = min(choice.times[n] or 0.0 for n in earlier) - best
        noise = " (floating-point rounding: take them as equal)" if gap < 1e-6 * best else ""
        won = f"{chosen} is chosen as faster than {', '.join(earlier)} by {gap * 1e3:.2g} ms{noise}"
    else:
        won = f"{chosen} is chosen as the first of them in the order tried"
    every = "all " if len(tied) == sum(p is not None for p in choice.plans.values()) else ""
    return f"{every}{len(tied)} schedules predict {best * 1e3:.3f} ms ({', '.join(tied)}): {why}; {won}"
