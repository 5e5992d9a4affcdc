"""The slowest stage, minimised: the exact search for a schedule of whole minibatches
(``ScheduleModel.asynchronous``): pair DP, lattice or hierarchy (docs/optimizer-search.md)."""

from __future__ import annotations

from dataclasses import replace

from partitioner.errors import InfeasibleError
from partitioner.graph import Profile
from partitioner.optimizer.options import SolveOptions
from partitioner.optimizer.pricing.memory import MemoryLimit
from partitioner.optimizer.pricing.price import assemble, global_lower_bound
from partitioner.optimizer.search.dp import DIRECT_MAX_UNITS, LevelProblem, Segment, solve_bottleneck
from partitioner.optimizer.search.hierarchy import solve_hierarchy
from partitioner.optimizer.search.lattice import Lattice, enumerate_lattice, solve_lattice
from partitioner.optimizer.search.plans import flat_like, stage_specs
from partitioner.optimizer.search.states import StateSet, more_downsets_than, without_free_sinks
from partitioner.plan import Cluster, Plan, SolverInfo

__all__ = ["LATTICE_MAX_STATES", "replica_cap", "slowest_stage", "solve_slowest"]

LATTICE_MAX_STATES = 400_000  # Inception-v3 has 221,565 downsets; NASNet ~6e12 (out of reach)


def replica_cap(profile: Profile, opts: SolveOptions) -> int | None:
    """The most replicas a stage may have: 1 for a straight pipeline, and never more than a
    minibatch has samples (a replica without a sample idles; the cost model, dividing a stage's
    time by its replicas, would not see it)."""
    if opts.straight:
        return 1
    return profile.batch_size if profile.batch_size else None


def slowest_stage(
    profile: Profile, cluster: Cluster, states: StateSet, opts: SolveOptions, min_replicas: int = 1
) -> tuple[float, list[Segment], float]:
    """The least slowest stage over ``states``, under the memory limit if any: (time, stages, bound)."""
    cap = replica_cap(profile, opts)
    levels = [(lv.devices, lv.link) for lv in cluster.levels]
    if len(levels) > 1:
        return solve_hierarchy(states, levels, cap)
    memory = None
    if cluster.memory_bytes is not None:
        limit = float(cluster.memory_bytes)
        memory = MemoryLimit.of(
            limit, profile, opts.optimizer, opts.schedule, cluster.gpus, opts.m, cluster.cores is not None
        )
    prob = LevelProblem(
        states, cluster.gpus, levels[0][1], min_replicas=min_replicas, max_replicas=cap, memory=memory
    )
    return solve_bottleneck(prob, global_lower_bound(profile, cluster))


def solve_slowest(
    profile: Profile, cluster: Cluster, states: StateSet, opts: SolveOptions
) -> tuple[Plan, float, bool]:
    """The plan of the least slowest stage: (plan, lower bound, proven optimal over every downset)."""
    comm = opts.activation_comm
    value, segments, lower = slowest_stage(profile, cluster, states, opts)
    info = SolverInfo("dp", 0.0, False)

    def priced(
        on: StateSet | Lattice,
        found: list[Segment],
        time: float | None = None,
        extra: dict[str, object] | None = None,
    ) -> Plan:
        specs = stage_specs(profile, on, found)
        return assemble(
            profile, cluster, specs, opts.schedule, opts.m, opts.optimizer, info, time, extra, comm
        )

    lattice = None
    if _lattice_applies(profile, cluster, states) and _limit_slack(profile, cluster, states, opts, value):
        lattice = _lattice_for(profile, states, comm)
    if lattice is not None:  # every downset, without pairs: exact where the pair DP was not
        cap = replica_cap(profile, opts)
        bound = global_lower_bound(profile, cluster)
        start = _on_lattice(states, lattice, segments)
        found, stages, low = solve_lattice(
            lattice, cluster.gpus, cluster.levels[0].link, bound, value, cap, start
        )
        searched = {"states": len(lattice.masks), "all_downsets": True, "search": "lattice"}
        try:  # (no memory model there: under a limit, its optimum is the answer if it fits)
            return priced(lattice, stages, found, searched), low, found <= low * (1 + 1e-4)
        except InfeasibleError:
            pass
    try:
        return priced(states, segments, value), lower, states.exact
    except InfeasibleError:
        if len(cluster.levels) == 1:
            raise
    # PipeDream's hierarchical recursion has no memory model: fall back to the memory-aware flat
    # search over the slowest level's link, priced on the real hierarchy
    _, segments, _ = slowest_stage(profile, flat_like(cluster), states, opts)
    return priced(states, segments), lower, False


def _limit_slack(
    profile: Profile, cluster: Cluster, states: StateSet, opts: SolveOptions, value: float
) -> bool:
    """Whether the memory limit (if any) left the search's optimum as fast as without it: only then
    may the lattice search, which has no memory model, find a faster plan that still fits."""
    if cluster.memory_bytes is None:
        return True
    free = slowest_stage(profile, replace(cluster, memory_bytes=None), states, opts)
    return value <= free[0] * (1 + 1e-9)


def _on_lattice(states: StateSet, lattice: Lattice, segments: list[Segment]) -> list[Segment] | None:
    """The pair search's plan in the lattice's numbering (its cuts are downsets too), if it maps."""
    if states.layer_ids != lattice.layer_ids or any(seg.inner for seg in segments):
        return None
    index = {0: 0, len(states) - 1: len(lattice.masks) - 1}
    for seg in segments:
        for state in (seg.start, seg.end):
            if state not in index:
                index[state] = lattice.index_of(states.masks[state])
    return [Segment(index[seg.start], index[seg.end], seg.replicas) for seg in segments]


def _lattice_applies(profile: Profile, cluster: Cluster, states: StateSet) -> bool:
    """Whether the pair DP had to fall back and the lattice search may list every downset (one
    level, few devices, and no early sign of more downsets than it lists)."""
    if states.exact or len(cluster.levels) > 1 or cluster.gpus > DIRECT_MAX_UNITS:
        return False
    return not more_downsets_than(without_free_sinks(profile), LATTICE_MAX_STATES)


def _lattice_for(profile: Profile, states: StateSet, comm: bool) -> Lattice | None:
    """All downsets as a lattice, where the lattice search applies (None beyond its caps)."""
    lattice = enumerate_lattice(without_free_sinks(profile), LATTICE_MAX_STATES)
    if lattice is None:
        return None
    lattice = replace(lattice, stage_s=states.stage_s)
    return lattice if comm else replace(lattice, act_bytes=lattice.act_bytes * 0.0)
