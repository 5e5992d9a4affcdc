"""From a profile to what a search runs on (states), and from what it found (segments) back to
stages on ranks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace

from partitioner.errors import InfeasibleError
from partitioner.graph import Profile
from partitioner.optimizer.pricing.price import StageSpec
from partitioner.optimizer.search.dp import Segment
from partitioner.optimizer.search.lattice import Lattice
from partitioner.optimizer.search.states import (
    StateSet,
    build_states,
    chain_states,
    downset_states,
    free_sinks,
    multi_order_states,
    thin_prefixes,
    without_free_sinks,
)
from partitioner.plan import Cluster, Plan

__all__ = [
    "HIERARCHY_MAX_STATES",
    "HIERARCHY_THIN_STATES",
    "fastest",
    "flat_like",
    "hierarchy_states",
    "inputs",
    "stage_specs",
    "states_for",
    "thin_states",
]

log = logging.getLogger(__name__)
HIERARCHY_MAX_STATES = 600  # inner levels need every segment's best time: cubic in the states
HIERARCHY_THIN_STATES = 200  # beyond that, prefixes of one order thinned evenly by compute


def inputs(profile: Profile) -> tuple[str, ...]:
    """The model's inputs (free: PipeDream zeroes them), which the first stage reads."""
    return tuple(n.id for n in profile.nodes if n.op == "input")


def states_for(profile: Profile, cluster: Cluster, activation_comm: bool) -> StateSet:
    """The states a search runs on: every downset up to ``states.DEFAULT_MAX_STATES`` on one level
    (:func:`hierarchy_states` on several), free sinks removed; cuts free without activation charges."""
    profile = without_free_sinks(profile)
    states = build_states(profile) if len(cluster.levels) == 1 else hierarchy_states(profile)
    if not activation_comm:
        states = replace(states, act_bytes=states.act_bytes * 0.0)
    return states


def hierarchy_states(profile: Profile) -> StateSet:
    """``build_states`` up to ``HIERARCHY_MAX_STATES``; beyond, the prefixes of the three orders
    thinned to ``HIERARCHY_THIN_STATES`` each (NASNet-Mobile 4x4: 0.24% faster than one order
    thinned so, which stays the fallback)."""
    states = downset_states(profile)
    if states is not None and len(states) <= HIERARCHY_MAX_STATES:
        return states
    multi = multi_order_states(profile)
    if len(multi) <= HIERARCHY_MAX_STATES:
        return multi
    log.info("hierarchy: thinning the states to %d prefixes per order", HIERARCHY_THIN_STATES)
    thin = thin_prefixes(multi, HIERARCHY_THIN_STATES)
    if thin is not None and len(thin) <= HIERARCHY_MAX_STATES:
        return thin
    return chain_states(profile, HIERARCHY_THIN_STATES)  # (free sinks already removed)


def thin_states(profile: Profile, most: int, comm: bool) -> StateSet:
    """Prefixes of the layer order, thinned evenly by compute to ``most`` (free sinks removed)."""
    states = chain_states(without_free_sinks(profile), most)
    return states if comm else replace(states, act_bytes=states.act_bytes * 0.0)


def flat_like(cluster: Cluster) -> Cluster:
    """One level of all the cluster's devices at its slowest link."""
    return Cluster.flat(cluster.gpus, cluster.slowest, cluster.memory_bytes)


def _flatten(
    seg: Segment, states: StateSet | Lattice, ranks: list[int]
) -> list[tuple[tuple[str, ...], list[int]]]:
    """Leaf stages of a (possibly hierarchical) segment, with the global ranks each one runs on."""
    if not seg.inner:
        return [(states.members(seg.start, seg.end), ranks)]
    unit = len(ranks) // seg.replicas
    out = []
    offset = 0
    for sub in seg.inner:
        width = _width(sub)
        picked = [ranks[u * unit + offset + x] for u in range(seg.replicas) for x in range(width)]
        out.extend(_flatten(sub, states, picked))
        offset += width
    return out


def _width(seg: Segment) -> int:
    """Devices a segment occupies inside one unit of its level."""
    if not seg.inner:
        return seg.replicas
    return seg.replicas * sum(_width(s) for s in seg.inner)


def stage_specs(profile: Profile, states: StateSet | Lattice, segments: list[Segment]) -> list[StageSpec]:
    """The stages of ``segments`` on consecutive ranks, the inputs on the first, free sinks beside
    their producers, each stage's nodes in the profile's order."""
    specs: list[StageSpec] = []
    next_rank = 0
    for seg in segments:
        width = _width(seg)
        for nodes, ranks in _flatten(seg, states, list(range(next_rank, next_rank + width))):
            specs.append(StageSpec(nodes, len(ranks), tuple(ranks)))
        next_rank += width
    order = {n.id: i for i, n in enumerate(profile.nodes)}
    riders: dict[str, list[str]] = {}
    for sink, producer in free_sinks(profile).items():
        riders.setdefault(producer, []).append(sink)
    out = []
    for i, spec in enumerate(specs):
        members = list(spec.nodes) + [r for n in spec.nodes for r in riders.get(n, [])]
        members += list(inputs(profile)) if i == 0 else []
        out.append(StageSpec(tuple(sorted(members, key=order.__getitem__)), spec.replicas, spec.ranks))
    return out


def fastest(makers: Iterable[Callable[[], Plan]]) -> Plan | None:
    """The fastest plan of those the makers give (the first of equals; None: none fits)."""
    best: Plan | None = None
    for make in makers:
        try:
            plan = make()
        except InfeasibleError:
            continue
        if best is None or plan.predicted.time_per_minibatch_s < best.predicted.time_per_minibatch_s:
            best = plan
    return best
