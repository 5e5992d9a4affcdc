"""Choose pipeline stages and per-stage replication for a profile on a cluster.

Pure Python + numpy (no torch): ``solve`` searches, ``evaluate`` prices a given plan.

Example:
    >>> from partitioner.graph import read_graph_txt
    >>> from partitioner.plan import Cluster
    >>> plan = solve(read_graph_txt("vgg16/graph.txt", 128), Cluster.flat(4))  # doctest: +SKIP
    >>> [s.replicas for s in plan.stages]  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile, at_microbatches
from partitioner.optimizer.options import SolveOptions
from partitioner.optimizer.pricing.memory import MemoryLimit
from partitioner.optimizer.pricing.price import StageSpec, assemble, gib, global_lower_bound, layer_compute_s
from partitioner.optimizer.pricing.recompute import recomputing, repriced
from partitioner.optimizer.search.dp import (
    DIRECT_MAX_UNITS,
    LevelProblem,
    Segment,
    solve_bottleneck,
)
from partitioner.optimizer.search.hierarchy import solve_hierarchy
from partitioner.optimizer.search.lattice import Lattice, enumerate_lattice, solve_lattice
from partitioner.optimizer.search.states import (
    StateSet,
    build_states,
    chain_states,
    downset_states,
    free_sinks,
    more_downsets_than,
    multi_order_states,
    thin_prefixes,
    without_free_sinks,
)
from partitioner.optimizer.search.sync import MAX_CHOICES, MAX_STEPS, solve_synchronous
from partitioner.plan import Cluster, Plan, SolverInfo

__all__ = ["evaluate", "solve", "solve_with"]

log = logging.getLogger(__name__)
HIERARCHY_MAX_STATES = 600  # inner levels need every segment's best time: cubic in the states
HIERARCHY_THIN_STATES = 200  # beyond that, prefixes of one order thinned evenly by compute
LATTICE_MAX_STATES = 400_000  # Inception-v3 has 221,565 downsets; NASNet ~6e12 (out of reach)
SYNC_CANDIDATE_STATES = 1000  # 1f1b/gpipe candidates each run a bottleneck search: thin beyond this


def _inputs(profile: Profile) -> tuple[str, ...]:
    return tuple(n.id for n in profile.nodes if n.op == "input")


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


def _specs(profile: Profile, states: StateSet | Lattice, segments: list[Segment]) -> list[StageSpec]:
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
        members += list(_inputs(profile)) if i == 0 else []
        out.append(StageSpec(tuple(sorted(members, key=order.__getitem__)), spec.replicas, spec.ranks))
    return out


def _states_for(profile: Profile, cluster: Cluster, activation_comm: bool) -> StateSet:
    profile = without_free_sinks(profile)
    states = build_states(profile) if len(cluster.levels) == 1 else _hierarchy_states(profile)
    if not activation_comm:
        states = replace(states, act_bytes=states.act_bytes * 0.0)
    return states


def _hierarchy_states(profile: Profile) -> StateSet:
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


def _search(
    profile: Profile, cluster: Cluster, states: StateSet, opts: SolveOptions, min_replicas: int = 1
) -> tuple[float, list[Segment], float]:
    """The bottleneck search (PipeDream's objective) under the memory limit, if any."""
    cap = 1 if opts.straight else None
    levels = [(lv.devices, lv.bandwidth) for lv in cluster.levels]
    if len(levels) > 1:
        return solve_hierarchy(states, levels, cap)
    memory = None
    if cluster.memory_bytes is not None:
        limit = float(cluster.memory_bytes)
        memory = MemoryLimit.of(limit, profile, opts.optimizer, opts.schedule, cluster.gpus, opts.m)
    prob = LevelProblem(
        states, cluster.gpus, levels[0][1], min_replicas=min_replicas, max_replicas=cap, memory=memory
    )
    return solve_bottleneck(prob, global_lower_bound(profile, cluster))


def _pipedream(
    profile: Profile, cluster: Cluster, states: StateSet, opts: SolveOptions
) -> tuple[Plan, float, bool]:
    comm, optimizer = opts.activation_comm, opts.optimizer
    value, segments, lower = _search(profile, cluster, states, opts)
    info = SolverInfo("dp", 0.0, False)
    lattice = None
    if _lattice_applies(profile, cluster, states) and _limit_slack(profile, cluster, states, opts, value):
        lattice = _lattice_for(profile, cluster, states, comm)
    if lattice is not None:  # every downset, without pairs: exact where the pair DP was not
        cap = 1 if opts.straight else None
        bw = cluster.levels[0].bandwidth
        bound = global_lower_bound(profile, cluster)
        start = _on_lattice(states, lattice, segments)
        found, stages, low = solve_lattice(lattice, cluster.gpus, bw, bound, value, cap, start)
        searched = {"states": len(lattice.masks), "all_downsets": True, "search": "lattice"}
        try:  # (no memory model there: under a limit, its optimum is the answer if it fits)
            plan = assemble(profile, cluster, _specs(profile, lattice, stages), "pipedream", 1, optimizer,
                            info, time_override=found, extra=searched, activation_comm=comm)  # fmt: skip
            return plan, low, found <= low * (1 + 1e-4)
        except InfeasibleError:
            pass
    try:
        plan = assemble(profile, cluster, _specs(profile, states, segments), "pipedream", 1, optimizer,
                        info, time_override=value, activation_comm=comm)  # fmt: skip
    except InfeasibleError:
        if len(cluster.levels) == 1:
            raise
        # PipeDream's hierarchical recursion has no memory model: fall back to the memory-aware
        # flat search over the slowest level's bandwidth, priced on the real hierarchy
        flat = _flat_like(cluster)
        _, segments, _ = _search(profile, flat, states, opts)
        plan = assemble(profile, cluster, _specs(profile, states, segments), "pipedream", 1, optimizer,
                        info, activation_comm=comm)  # fmt: skip
        return plan, lower, False
    return plan, lower, states.exact


def _limit_slack(
    profile: Profile, cluster: Cluster, states: StateSet, opts: SolveOptions, value: float
) -> bool:
    """Whether the memory limit (if any) left the search's optimum as fast as without it: only then
    may the lattice search, which has no memory model, find a faster plan that still fits."""
    if cluster.memory_bytes is None:
        return True
    free = _search(profile, replace(cluster, memory_bytes=None), states, opts)
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


def _lattice_for(profile: Profile, cluster: Cluster, states: StateSet, comm: bool) -> Lattice | None:
    """All downsets as a lattice, where the lattice search applies (None beyond its caps)."""
    lattice = enumerate_lattice(without_free_sinks(profile), LATTICE_MAX_STATES)
    if lattice is None or comm:
        return lattice
    return replace(lattice, act_bytes=lattice.act_bytes * 0.0)


def _synchronous(
    profile: Profile, cluster: Cluster, states: StateSet, opts: SolveOptions
) -> tuple[Plan, float, bool]:
    """The synchronous model's optimum on one level by branch and bound (``sync.py``), proven.

    Where that cannot run or prove its plan (hierarchies, more pairs than it prices, a plan over
    the memory limit, states short of every downset), the best of it (on prefixes of the layer
    order thinned to what it can price, if need be) and of bubble-aware candidates (on at most
    ``SYNC_CANDIDATE_STATES`` states), each priced by the synchronous model: bottleneck-optimal
    plans with a floor on replicas per stage (fewer, wider stages: smaller bubble), straight
    bottleneck plans on 1, 2, 4, .. devices, and the data-parallel, uniform, parameter- and
    time-balanced baselines.
    """
    from partitioner.optimizer.search.candidates import (
        data_parallel,
        parameter_balanced,
        time_balanced,
        uniform,
    )

    schedule, m, optimizer, straight, comm = (
        opts.schedule, opts.m, opts.optimizer, opts.straight, opts.activation_comm
    )  # fmt: skip
    gpus = cluster.gpus
    powers = sorted({1, *(2**i for i in range(int(math.log2(gpus)) + 1)), gpus})
    info = SolverInfo("dp", 0.0, False)
    exact = _exact_synchronous(profile, cluster, states, opts)
    if exact is not None and exact[2]:
        return exact
    if len(states) > SYNC_CANDIDATE_STATES:  # candidates and the exact search on fewer cuts
        most = int(math.sqrt(2 * MAX_CHOICES / (1 if straight else gpus)))
        states = _thin_states(profile, min(most, SYNC_CANDIDATE_STATES), comm)
        if exact is None:
            exact = _exact_synchronous(profile, cluster, states, opts)

    def bottleneck(where: Cluster, floor: int, line: bool) -> Plan:
        _, segments, _ = _search(profile, where, states, replace(opts, straight=line), floor)
        specs = _specs(profile, states, segments)
        return assemble(profile, cluster, specs, schedule, m, optimizer, info, activation_comm=comm)

    floors = [] if straight else [1] if len(cluster.levels) > 1 else powers  # hierarchies ignore floors
    makers = [partial(bottleneck, cluster, floor, False) for floor in floors]
    for units in powers:
        flat = Cluster.flat(units, cluster.levels[0].bandwidth, cluster.memory_bytes)
        makers.append(partial(bottleneck, flat, 1, True))
    baselines = [uniform, parameter_balanced, time_balanced] + ([] if straight else [data_parallel])
    makers += [partial(make, profile, cluster, schedule, m, optimizer) for make in baselines]
    best: Plan | None = None
    for make in makers:
        try:
            plan = make()
        except InfeasibleError:
            continue
        if best is None or plan.predicted.time_per_minibatch_s < best.predicted.time_per_minibatch_s:
            best = plan
    if exact is not None and (
        best is None or exact[0].predicted.time_per_minibatch_s <= best.predicted.time_per_minibatch_s
    ):
        return exact[0], max(exact[1], _sync_bound(profile, cluster)), False
    if best is None:
        raise InfeasibleError("no plan fits in memory")
    return best, max(exact[1] if exact else 0.0, _sync_bound(profile, cluster)), False


def _exact_synchronous(
    profile: Profile, cluster: Cluster, states: StateSet, opts: SolveOptions
) -> tuple[Plan, float, bool] | None:
    """The branch-and-bound optimum on one level (``sync.py``), when it is small enough to run;
    (plan, lower bound valid for every plan, proven optimal over all downsets). With a memory
    limit the optimum without one is tried first; if it does not fit, the search keeps only
    stages that fit with all M microbatches held (exact for gpipe, cautious for 1f1b). On a
    hierarchy it searches as if every link were the slowest: a good candidate, no proof."""
    schedule, m, optimizer, comm = opts.schedule, opts.m, opts.optimizer, opts.activation_comm
    cap = 1 if opts.straight else cluster.gpus
    steps = MAX_STEPS if states.exact else 60  # no proof to finish on a subset of the cuts
    bandwidth = min(level.bandwidth for level in cluster.levels)  # hierarchies: a candidate only
    limit = cluster.memory_bytes
    memory = None
    if limit is not None:
        memory = MemoryLimit.of(limit + 0.5, profile, optimizer, schedule, cluster.gpus, m)
    info = SolverInfo("dp", 0.0, False)
    for held in (None, memory) if memory is not None else (None,):  # unlimited first: often fits
        found = solve_synchronous(states, cluster.gpus, bandwidth, m, cap, steps, held)
        if found is None:
            return None
        value, segments, lower = found
        try:
            plan = assemble(profile, cluster, _specs(profile, states, segments), schedule, m, optimizer,
                            info, activation_comm=comm)  # fmt: skip
        except InfeasibleError:
            continue
        if len(cluster.levels) > 1:  # searched at the slowest bandwidth: neither optimal nor a bound
            return plan, 0.0, False
        # with the limit, the search holds all M microbatches: gpipe's model, more than 1f1b's;
        # it minimises the 1f1b/gpipe time, so neither its optimum nor its bound is zb1p's
        sound = states.exact and (held is None or schedule == "gpipe") and schedule != "zb1p"
        return plan, lower if sound else 0.0, sound and lower >= value * (1 - 1e-9)
    return None


def _thin_states(profile: Profile, most: int, comm: bool) -> StateSet:
    """Prefixes of the layer order, thinned evenly by compute to ``most`` (free sinks removed)."""
    states = chain_states(without_free_sinks(profile), most)
    return states if comm else replace(states, act_bytes=states.act_bytes * 0.0)


def _sync_bound(profile: Profile, cluster: Cluster) -> float:
    return layer_compute_s(profile) / cluster.gpus


def solve(
    profile: Profile,
    cluster: Cluster,
    schedule: str = "pipedream",
    microbatches: int = 1,
    optimizer: str = "sgd",
    straight: bool = False,
    solver: str = "dp",
    activation_comm: bool = True,
    recompute: str = "none",
    virtual_stages: int = 1,
) -> Plan:
    """The fastest plan under the schedule's cost model that fits the cluster's memory.

    ``interleaved`` with ``virtual_stages`` v: ``gpus * v`` stages, stage ``s`` on rank ``s mod
    gpus`` (:mod:`partitioner.optimizer.interleaved`; cuts from candidates, not an exact search);
    ``zbv``: ``2 gpus`` stages laid out as a V, planned the same way.

    The arguments are :class:`~partitioner.optimizer.options.SolveOptions`' fields. ``recompute``:
    ``none``; ``all`` (every stage recomputes its forward in backward); ``auto`` (the plan without
    recomputation if one fits; otherwise the plan searched with every stage recomputing, then each
    stage that fits without recomputation keeps its activations).

    Raises:
        PlanError: bad schedule, optimizer, solver, recompute mode or microbatch count.
        InfeasibleError: nothing fits; the message names the smallest memory that would.
    """
    opts = SolveOptions(
        schedule, microbatches, optimizer, straight, solver, activation_comm, recompute, virtual_stages
    )
    return solve_with(profile, cluster, opts.checked(profile))


def solve_with(profile: Profile, cluster: Cluster, opts: SolveOptions) -> Plan:
    """:func:`solve` with its options as one value (checked by ``SolveOptions.checked``)."""
    if opts.schedule in ("interleaved", "zbv"):
        return _interleaved(profile, cluster, opts)
    if opts.recompute != "all":
        try:
            plan = _solve_kept(profile, cluster, opts)
        except InfeasibleError:
            if opts.recompute == "none" or cluster.memory_bytes is None:
                raise
        else:
            return replace(plan, extra={**plan.extra, "recompute": opts.recompute})
    where = f"{gib(cluster.memory_bytes or 0)} per GPU on {cluster.gpus} GPUs"
    try:  # (the search's own estimate of what would fit ignores the inputs recomputing stages keep)
        searched = _solve_kept(recomputing(profile), cluster, opts)
    except InfeasibleError:
        raise InfeasibleError(
            f"no plan fits in {where} even with every stage recomputing; raise --memory or add GPUs"
        ) from None
    try:
        return repriced(profile, cluster, searched, opts.recompute, opts.activation_comm)
    except InfeasibleError as exc:
        raise InfeasibleError(f"no plan fits in {where} even with every stage recomputing: {exc}") from None


def _interleaved(profile: Profile, cluster: Cluster, opts: SolveOptions) -> Plan:
    from partitioner.optimizer.interleaved import solve_interleaved

    start, m = time.perf_counter(), opts.m
    straight = replace(opts, schedule="1f1b", straight=True, recompute="none", virtual_stages=1)
    opts = replace(opts, virtual_stages=2) if opts.schedule == "zbv" else opts  # (2 stages per GPU)
    plan = solve_interleaved(
        at_microbatches(profile, m), cluster, m, opts.optimizer, opts.virtual_stages,
        lambda wide: _solve_kept(profile, wide, straight), opts.activation_comm, opts.recompute,
        opts.schedule,
    )  # fmt: skip
    info = replace(plan.solver, solve_time_s=time.perf_counter() - start)
    return replace(plan, solver=info, extra={**plan.extra, "recompute": opts.recompute})


def _solve_kept(profile: Profile, cluster: Cluster, opts: SolveOptions) -> Plan:
    """``solve`` without recomputation on ``profile``, the microbatch count made usable."""
    plan = _solve_at(profile, cluster, opts)
    for _ in range(3):
        usable = _usable_microbatches(plan, profile.batch_size)
        if usable == plan.microbatches:
            break
        plan = _solve_at(profile, cluster, replace(opts, microbatches=usable))
        plan = replace(plan, extra={**plan.extra, "microbatches_asked": opts.microbatches})
    return plan


def _usable_microbatches(plan: Plan, batch_size: int | None) -> int:
    """A microbatch count every replica of a synchronous plan can use: the synchronous schedules hand
    microbatches round-robin to a stage's replicas, and the cost model prices a stage of r replicas
    at 1/r of its time, true when r divides the count. Raised to lcm(count, replicas) where the batch
    splits into that many; otherwise the plan's own count (its replicas then wait, as priced by no one)."""
    m = plan.microbatches
    if plan.schedule == "pipedream" or all(m % s.replicas == 0 for s in plan.stages):
        return m
    wanted = math.lcm(m, *(s.replicas for s in plan.stages))
    if batch_size and (wanted > batch_size or batch_size % wanted):
        return m
    return wanted


def _solve_at(profile: Profile, cluster: Cluster, opts: SolveOptions) -> Plan:
    profile = at_microbatches(profile, opts.m)
    if opts.solver == "ilp":
        from partitioner.optimizer.search.ilp import solve_ilp

        return solve_ilp(profile, cluster, opts.schedule, opts.m, opts.optimizer, opts.straight,
                         opts.activation_comm)  # fmt: skip
    start = time.perf_counter()
    states = _states_for(profile, cluster, opts.activation_comm)
    try:
        search = _pipedream if opts.schedule == "pipedream" else _synchronous
        plan, lower, exact = search(profile, cluster, states, opts)
    except InfeasibleError:
        raise _infeasible(profile, cluster, opts) from None
    if not exact:
        lower = min(lower, global_lower_bound(profile, cluster))
    info = SolverInfo("dp", time.perf_counter() - start, exact, lower)
    extra = {"states": len(states), "all_downsets": states.exact, "search": "pairs"}
    return _with(plan, info, {**extra, **plan.extra})


def _with(plan: Plan, info: SolverInfo, extra: Mapping[str, object]) -> Plan:
    from dataclasses import replace

    return replace(plan, solver=info, extra={**plan.extra, **extra})


def _fits(profile: Profile, cluster: Cluster, opts: SolveOptions) -> bool:
    try:
        search = _pipedream if opts.schedule == "pipedream" else _synchronous
        search(profile, _flat_like(cluster), chain_states(profile, 64), opts)
    except InfeasibleError:
        return False
    return True


def _flat_like(cluster: Cluster) -> Cluster:
    slowest = min(level.bandwidth for level in cluster.levels)
    return Cluster.flat(cluster.gpus, slowest, cluster.memory_bytes)


def _infeasible(profile: Profile, cluster: Cluster, opts: SolveOptions) -> InfeasibleError:
    """Find (by bisection on the limit) the smallest per-device memory that admits a plan."""
    from dataclasses import replace

    lo, hi = 1.0, float(2**50)
    if not _fits(profile, replace(cluster, memory_bytes=int(hi)), opts):
        return InfeasibleError("no plan fits in memory at any size")
    while hi - lo > max(1.0, hi * 1e-3):
        mid = (lo + hi) / 2
        if _fits(profile, replace(cluster, memory_bytes=int(mid)), opts):
            hi = mid
        else:
            lo = mid
    have = gib(cluster.memory_bytes or 0)
    lighter = ", or use --optimizer sgd" if opts.optimizer != "sgd" else ""
    return InfeasibleError(
        f"no plan fits in {have} per GPU on {cluster.gpus} GPUs; about {gib(hi)} would "
        f"(raise --memory or add GPUs{lighter})"
    )


def evaluate(
    profile: Profile,
    cluster: Cluster,
    cuts: Sequence[str],
    replicas: Sequence[int],
    schedule: str = "pipedream",
    microbatches: int = 1,
    optimizer: str = "sgd",
    activation_comm: bool = True,
    recompute: str = "none",
    virtual_stages: int = 1,
) -> Plan:
    """Price a fixed plan: ``cuts`` are the last layer of every stage but the last (topological order).
    ``interleaved`` with ``virtual_stages`` v: ``gpus * v`` stages of one device, stage ``s`` on rank
    ``s mod gpus``.

    ``recompute``: ``none``, ``all``, or ``auto`` (exactly the stages over the memory limit recompute).

    Raises:
        PlanError: unknown layer names, cuts out of order, or replicas not one per stage.
    """
    opts = SolveOptions(
        schedule, microbatches, optimizer, activation_comm=activation_comm, recompute=recompute
    )
    m = opts.checked(profile).m
    profile = at_microbatches(profile, m)
    start = time.perf_counter()
    layers = [n.id for n in profile.nodes if n.op != "input"]
    names = {n.name: n.id for n in profile.nodes} | {lid: lid for lid in layers}
    unknown = [c for c in cuts if c not in names or names[c] not in layers]
    if unknown:
        raise PlanError(f"--cuts names unknown layers: {', '.join(unknown)}")
    positions = [layers.index(names[c]) + 1 for c in cuts]
    if positions != sorted(set(positions)) or (positions and positions[-1] >= len(layers)):
        raise PlanError("--cuts must name distinct layers in topological order, not the last layer")
    bounds = [0, *positions, len(layers)]
    if len(replicas) != len(bounds) - 1:
        raise PlanError(f"--replicas needs {len(bounds) - 1} numbers (one per stage), got {len(replicas)}")
    if any(r < 1 for r in replicas):
        raise PlanError("--replicas must all be >= 1")
    specs, rank = [], 0
    for i, r in enumerate(replicas):
        nodes = tuple(layers[bounds[i] : bounds[i + 1]])
        specs.append(StageSpec(nodes, r, tuple(range(rank, rank + r))))
        rank += r
    virtual_stages = 2 if schedule == "zbv" else virtual_stages
    if virtual_stages > 1:
        specs = _laid_out(specs, schedule, virtual_stages, m)
    order = {n.id: i for i, n in enumerate(profile.nodes)}
    specs[0] = StageSpec(tuple(sorted(_inputs(profile) + specs[0].nodes, key=order.__getitem__)),
                         specs[0].replicas, specs[0].ranks)  # fmt: skip
    _check_closed(profile, specs)
    info = SolverInfo("evaluate", 0.0, False)
    plan = assemble(profile, cluster, specs, schedule, m, optimizer, info, activation_comm=activation_comm,
                    recompute=recompute, virtual=virtual_stages)  # fmt: skip
    if schedule in ("interleaved", "zbv"):
        from partitioner.optimizer.interleaved import played

        plan = played(profile, plan, activation_comm, recompute)
    return _with(plan, SolverInfo("evaluate", time.perf_counter() - start, False), {})


def _laid_out(specs: list[StageSpec], schedule: str, virtual: int, m: int) -> list[StageSpec]:
    """``evaluate``'s stages on ranks ``s mod gpus`` (interleaved's virtual stages) or, under zbv,
    as its V (stages ``r`` and ``2 gpus - 1 - r`` on rank ``r``)."""
    from partitioner.optimizer.interleaved import check_layout, layout_specs

    if schedule == "zbv" and (len(specs) % 2 or any(s.replicas != 1 for s in specs)):
        raise PlanError(f"--schedule zbv needs an even number of stages (2 per GPU) of one device each, "
                        f"got {len(specs)}")  # fmt: skip
    if schedule not in ("interleaved", "zbv") or len(specs) % virtual or any(s.replicas != 1 for s in specs):
        raise PlanError(
            f"--virtual-stages {virtual} needs --schedule interleaved and a multiple of {virtual} stages "
            "of one device each"
        )
    check_layout(schedule, len(specs) // virtual, virtual, m)
    return layout_specs(schedule, [s.nodes for s in specs], len(specs) // virtual)


def _check_closed(profile: Profile, specs: Sequence[StageSpec]) -> None:
    where = {nid: i for i, s in enumerate(specs) for nid in s.nodes}
    for node in profile.nodes:
        for src in node.inputs:
            if where.get(src, 0) > where.get(node.id, 0):
                raise PlanError(f"layer {node.id} would run before its input {src}: cuts break the graph")
