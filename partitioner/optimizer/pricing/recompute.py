"""Searching plans whose stages recompute their forward in backward (activation checkpointing).

The searches (dp, lattice, sync, hierarchy, ilp) have their own, vectorised memory models. Rather than
teach each of them recomputation, a recomputing search runs on :func:`recomputing`'s profile: every
layer's backward also pays its forward (exact, as the cost model prices it) and keeps no activations
(optimistic: a recomputing stage still keeps its inputs and, during one backward, one item's
activations, which depend on where the cuts fall). :func:`repriced` then prices the found stages with
:func:`~partitioner.optimizer.pricing.schedules.price_stage` and checks the memory limit exactly,
so no plan that
does not fit is ever returned; a search may only miss a plan that fits by a margin its optimism hid.
"""

from __future__ import annotations

from dataclasses import replace

from partitioner.graph import Profile, at_microbatches
from partitioner.optimizer.pricing.price import StageSpec, assemble
from partitioner.optimizer.pricing.schedules import model
from partitioner.plan import Cluster, Plan

__all__ = ["recomputing", "repriced"]


def recomputing(profile: Profile) -> Profile:
    """The profile a search for recomputing stages runs on: backward + forward (fixed times too, as
    the forward runs again per microbatch), nothing saved but the loss's (the output node's: the
    runtime runs the loss outside the recomputed forward, ``StageLoad.kept_bytes``)."""
    nodes = tuple(
        replace(n, backward_ms=n.backward_ms + n.forward_ms,
                saved_bytes=n.saved_bytes if n.op == "output" else 0,
                backward_fixed_ms=n.backward_fixed_ms + n.forward_fixed_ms)
        for n in profile.nodes
    )  # fmt: skip
    return replace(profile, nodes=nodes)


def repriced(profile: Profile, cluster: Cluster, plan: Plan, recompute: str, activation_comm: bool) -> Plan:
    """``plan``'s stages priced on the real profile with ``recompute`` (``all`` or ``auto``).

    Raises:
        InfeasibleError: a stage does not fit the memory limit even when it recomputes.
    """
    specs = [StageSpec(s.nodes, s.replicas, s.ranks) for s in plan.stages]
    profile = at_microbatches(profile, model(plan.schedule).microbatches(plan.microbatches))
    priced = assemble(
        profile, cluster, specs, plan.schedule, plan.microbatches, plan.optimizer, plan.solver,
        extra=dict(plan.extra), activation_comm=activation_comm, recompute=recompute,
    )  # fmt: skip
    return replace(priced, extra={**priced.extra, "recompute": recompute})
