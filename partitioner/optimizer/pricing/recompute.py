"""Searching plans whose stages recompute their forward in backward: the searches run on a
recomputing profile (optimistic) and the plan is re-priced exactly, so none that does not fit is
returned (docs/optimizer-pricing.md)."""

from __future__ import annotations

from dataclasses import replace

from partitioner.graph import Profile
from partitioner.optimizer.pricing.price import StageSpec, assemble
from partitioner.optimizer.pricing.schedules import model, priced_profile
from partitioner.optimizer.pricing.simulate import played
from partitioner.plan import Cluster, Plan
from partitioner.sized import SizedCost

__all__ = ["recomputing", "repriced"]


def recomputing(profile: Profile) -> Profile:
    """The profile a search for recomputing stages runs on: backward + forward (fixed times and the
    times at each measured size too, as the forward runs again per microbatch, before a split
    backward's B), nothing saved but the loss's (the output node's: the runtime runs the loss
    outside the recomputed forward, ``StageLoad.kept_bytes``)."""
    nodes = tuple(
        replace(n, backward_ms=n.backward_ms + n.forward_ms,
                saved_bytes=n.saved_bytes if n.op == "output" else 0,
                backward_fixed_ms=n.backward_fixed_ms + n.forward_fixed_ms,
                sized=tuple(_again(e) for e in n.sized))
        for n in profile.nodes
    )  # fmt: skip
    return replace(profile, nodes=nodes)


def _again(e: SizedCost) -> SizedCost:
    """One measured size with its forward run again in the backward (in B, where timed apart)."""
    return replace(e, backward_ms=e.backward_ms + e.forward_ms, input_ms=e.input_ms + e.forward_ms * e.split)


def _search_extra(plan: Plan) -> dict[str, object]:
    """``plan.extra`` without what a simulation's pricing added (a re-priced plan is played again)."""
    return {k: v for k, v in plan.extra.items() if k not in ("priced_by", "closed_form_s")}


def repriced(profile: Profile, cluster: Cluster, plan: Plan, recompute: str, activation_comm: bool) -> Plan:
    """``plan``'s stages priced on the real profile with ``recompute`` (``all`` or ``auto``).

    Raises:
        InfeasibleError: a stage does not fit the memory limit even when it recomputes.
    """
    specs = [StageSpec(s.nodes, s.replicas, s.ranks) for s in plan.stages]
    profile = priced_profile(profile, plan.schedule, model(plan.schedule).microbatches(plan.microbatches))
    priced = assemble(
        profile, cluster, specs, plan.schedule, plan.microbatches, plan.optimizer, plan.solver,
        extra=_search_extra(plan), activation_comm=activation_comm, recompute=recompute,
    )  # fmt: skip
    if model(plan.schedule).simulated:
        priced = played(profile, priced, activation_comm, recompute)
    return replace(priced, extra={**priced.extra, "recompute": recompute})
