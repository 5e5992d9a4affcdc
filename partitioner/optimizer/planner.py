"""The strategy, written once: which search a request runs, and what it falls back to (the schedule's
model picks it; recomputation, usable microbatches and the memory that would fit around it:
docs/optimizer-search.md)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile
from partitioner.optimizer.options import SolveOptions
from partitioner.optimizer.pricing.memory import deferred_as_saved
from partitioner.optimizer.pricing.price import StageSpec, assemble, gib, global_lower_bound
from partitioner.optimizer.pricing.recompute import recomputing, repriced
from partitioner.optimizer.pricing.schedules import model, priced_profile
from partitioner.optimizer.pricing.simulate import played
from partitioner.optimizer.search.bottleneck import solve_slowest
from partitioner.optimizer.search.candidates import (
    best_width,
    data_parallel,
    parameter_balanced,
    time_balanced,
    uniform,
)
from partitioner.optimizer.search.flushed import recomputing_applies, solve_flushed, solve_recomputing
from partitioner.optimizer.search.ilp import solve_ilp
from partitioner.optimizer.search.laid_out import check_layout, layout_specs, solve_laid_out
from partitioner.optimizer.search.plans import fastest, flat_like, inputs, states_for
from partitioner.optimizer.search.states import StateSet, chain_states
from partitioner.plan import Cluster, Plan, SolverInfo

__all__ = ["alternatives", "evaluate", "solve", "solve_with"]

Search = Callable[[Profile, Cluster, StateSet, SolveOptions], tuple[Plan, float, bool]]


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
    gpus``; ``zbv``: ``2 gpus`` stages laid out as a V (candidate cuts, not an exact search).

    The arguments are :class:`~partitioner.optimizer.options.SolveOptions`' fields. ``recompute``:
    ``none``; ``all`` (every stage recomputes its forward in backward); ``auto`` (under a memory limit,
    the faster of the plan without recomputation, if one fits, and the plan searched with every stage
    recomputing, then each stage that fits without recomputation keeping its activations).

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
    if model(opts.schedule).laid_out:
        return _laid_out(profile, cluster, opts)
    proven = _solve_recomputing(profile, cluster, opts)  # (None where it does not apply)
    if proven is not None:  # the best plan, recomputing or not (on a hierarchy, as at its slowest link)
        return proven
    kept: Plan | None = None
    if opts.recompute != "all":
        final = opts.recompute == "none" or cluster.memory_bytes is None  # else recomputation comes next
        try:
            plan = _solve_kept(profile, cluster, opts, explain=final)
            kept = replace(plan, extra={**plan.extra, "recompute": opts.recompute})
        except InfeasibleError:
            if final:
                raise
        if final and kept is not None:
            return kept
    return _faster(_recomputed(profile, cluster, opts, kept), kept)


def _recomputed(profile: Profile, cluster: Cluster, opts: SolveOptions, kept: Plan | None) -> Plan:
    """The plan searched with every stage recomputing, then re-priced (``auto``: each stage that fits
    without recomputing keeps its activations), or ``kept`` where that plan does not fit."""
    where = f"{gib(cluster.memory_bytes or 0)} per GPU on {cluster.gpus} GPUs"
    try:  # (the search's own estimate of what would fit ignores the inputs recomputing stages keep)
        searched = _solve_kept(recomputing(profile), cluster, opts, explain=False)  # (message replaced)
    except InfeasibleError:
        if kept is not None:
            return kept
        raise InfeasibleError(
            f"no plan fits in {where} even with every stage recomputing; raise --memory or add GPUs"
        ) from None
    try:
        return repriced(profile, cluster, searched, opts.recompute, opts.activation_comm)
    except InfeasibleError as exc:
        if kept is not None:
            return kept
        raise InfeasibleError(f"no plan fits in {where} even with every stage recomputing: {exc}") from None


def _faster(plan: Plan, other: Plan | None) -> Plan:
    """``other`` where it is at least as fast as ``plan``, else ``plan``: the plan kept without
    recomputing wins a tie (one that fits so can be slower than one that recomputes, as a stage with
    more replicas may fit only when it does; never faster for free)."""
    if other is None:
        return plan
    return other if other.predicted.time_per_minibatch_s <= plan.predicted.time_per_minibatch_s else plan


def _solve_recomputing(profile: Profile, cluster: Cluster, opts: SolveOptions) -> Plan | None:
    """The exact search over which stages recompute (``flushed.solve_recomputing``), where it
    applies (``recomputing_applies``); None elsewhere or where nothing fits."""
    if not recomputing_applies(cluster, opts) or opts.solver != "dp":
        return None
    try:
        plan = _solve_kept(profile, cluster, opts, explain=False, search=solve_recomputing)
    except InfeasibleError:
        return None
    return replace(plan, extra={**plan.extra, "recompute": opts.recompute})


def _laid_out(profile: Profile, cluster: Cluster, opts: SolveOptions) -> Plan:
    """Candidate cuts for a schedule that lays several stages on each GPU, seeded by the exact
    straight plan of its model's ``seed_schedule`` on one device per stage."""
    sched, start, m = model(opts.schedule), time.perf_counter(), opts.m
    seed = replace(opts, schedule=sched.seed_schedule, straight=True, recompute="none", virtual_stages=1)
    priced = priced_profile(profile, opts.schedule, m)
    plan = solve_laid_out(
        priced, cluster, m, opts.optimizer, sched.virtual(opts.virtual_stages),
        lambda wide: _solve_kept(profile, wide, seed), opts.activation_comm, opts.recompute, opts.schedule,
    )  # fmt: skip
    info = replace(plan.solver, solve_time_s=time.perf_counter() - start)
    return replace(plan, solver=info, extra={**plan.extra, "recompute": opts.recompute})


def _solve_kept(
    profile: Profile, cluster: Cluster, opts: SolveOptions, explain: bool = True, search: Search | None = None
) -> Plan:
    """``solve`` without recomputation on ``profile``, the microbatch count made usable; ``explain``:
    an InfeasibleError names the memory that would fit (a bisection of searches: skipped where the
    caller tries recomputation next). ``search``: instead of the schedule's own (its plans priced
    with ``opts.recompute``)."""
    plan = _solve_at(profile, cluster, opts, explain, search)
    for _ in range(3):
        usable = _usable_microbatches(plan, profile.batch_size)
        if usable == plan.microbatches:
            break
        try:  # (more microbatches hold more items on some stages: nothing need fit there)
            again = _solve_at(profile, cluster, replace(opts, microbatches=usable), False, search)
        except InfeasibleError:
            break  # the plan at its own count, which fits (its replicas then wait, as priced by no one)
        plan = replace(again, extra={**again.extra, "microbatches_asked": opts.microbatches})
    return plan


def _usable_microbatches(plan: Plan, batch_size: int | None) -> int:
    """A microbatch count every replica of a flushing plan can use: it hands microbatches round-robin
    to a stage's replicas, and the cost model prices a stage of r replicas at 1/r of its time, true
    when r divides the count. Raised to lcm(count, replicas) where the batch splits into that many;
    otherwise the plan's own count (its replicas then wait, as priced by no one)."""
    m = plan.microbatches
    if model(plan.schedule).asynchronous or all(m % s.replicas == 0 for s in plan.stages):
        return m
    wanted = math.lcm(m, *(s.replicas for s in plan.stages))
    if batch_size and (wanted > batch_size or batch_size % wanted):
        return m
    return wanted


def _search(opts: SolveOptions) -> Search:
    """The exact search of the schedule's objective."""
    return solve_slowest if model(opts.schedule).asynchronous else solve_flushed


def _solve_at(
    profile: Profile, cluster: Cluster, opts: SolveOptions, explain: bool = True, search: Search | None = None
) -> Plan:
    """The search's plan at ``opts.m`` microbatches, priced by the simulation where the schedule's
    closed form only ranks plans (``ScheduleModel.simulated``)."""
    profile = priced_profile(profile, opts.schedule, opts.m)
    plan = _searched_at(profile, cluster, opts, explain, search)
    if not model(opts.schedule).simulated:
        return plan
    return played(profile, plan, opts.activation_comm, "none" if search is None else opts.recompute)


def _searched_at(
    profile: Profile, cluster: Cluster, opts: SolveOptions, explain: bool, search: Search | None = None
) -> Plan:
    if opts.solver == "ilp":
        return solve_ilp(profile, cluster, opts.schedule, opts.m, opts.optimizer, opts.straight,
                         opts.activation_comm)  # fmt: skip
    start = time.perf_counter()
    states = states_for(deferred_as_saved(profile, opts.schedule), cluster, opts.activation_comm)
    states = states.with_actions(cluster.action_for(opts.schedule), model(opts.schedule).actions(opts.m))
    try:
        plan, lower, exact = (search or _search(opts))(profile, cluster, states, opts)
    except InfeasibleError:
        raise (_infeasible(profile, cluster, opts) if explain else InfeasibleError("no plan fits")) from None
    if not exact:
        lower = min(lower, global_lower_bound(profile, cluster))
    info = SolverInfo("dp", time.perf_counter() - start, exact, lower)
    extra = {"states": len(states), "all_downsets": states.exact, "search": "pairs"}
    return replace(plan, solver=info, extra={**plan.extra, **extra, **plan.extra})  # (the search's own win)


def _fits(profile: Profile, cluster: Cluster, opts: SolveOptions) -> bool:
    try:
        _search(opts)(profile, flat_like(cluster), chain_states(profile, 64), opts)
    except InfeasibleError:
        return False
    return True


def _infeasible(profile: Profile, cluster: Cluster, opts: SolveOptions) -> InfeasibleError:
    """Find (by bisection on the limit) the smallest per-device memory that admits a plan."""
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
    A schedule that lays several stages on each GPU takes ``gpus * v`` stages of one device, laid out
    as it lays them (``interleaved``: stage ``s`` on rank ``s mod gpus``; ``zbv``: a V of 2 per GPU).

    ``recompute``: ``none``, ``all``, or ``auto`` (exactly the stages over the memory limit recompute).

    Raises:
        PlanError: unknown layer names, cuts out of order, or replicas not one per stage.
    """
    opts = SolveOptions(
        schedule, microbatches, optimizer, False, "dp", activation_comm, recompute, virtual_stages
    )
    m = opts.checked(profile).m
    profile = priced_profile(profile, schedule, m)
    start = time.perf_counter()
    specs = _fixed_stages(profile, cuts, replicas)
    sched = model(schedule)
    virtual = sched.virtual(virtual_stages)
    if virtual > 1:
        specs = _laid_out_specs(specs, schedule, virtual, m)
    order = {n.id: i for i, n in enumerate(profile.nodes)}
    specs[0] = StageSpec(tuple(sorted(inputs(profile) + specs[0].nodes, key=order.__getitem__)),
                         specs[0].replicas, specs[0].ranks)  # fmt: skip
    _check_closed(profile, specs)
    info = SolverInfo("evaluate", 0.0, False)
    plan = assemble(profile, cluster, specs, schedule, m, optimizer, info, activation_comm=activation_comm,
                    recompute=recompute, virtual=virtual)  # fmt: skip
    if sched.simulated:
        plan = played(profile, plan, activation_comm, recompute)
    return replace(plan, solver=SolverInfo("evaluate", time.perf_counter() - start, False))


def _fixed_stages(profile: Profile, cuts: Sequence[str], replicas: Sequence[int]) -> list[StageSpec]:
    """The stages ``cuts`` (layer names or ids) make of the layers, on consecutive ranks."""
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
        specs.append(StageSpec(tuple(layers[bounds[i] : bounds[i + 1]]), r, tuple(range(rank, rank + r))))
        rank += r
    return specs


def _laid_out_specs(specs: list[StageSpec], schedule: str, virtual: int, m: int) -> list[StageSpec]:
    """``evaluate``'s stages on the GPUs a laid-out schedule puts them on."""
    if len(specs) % virtual or any(s.replicas != 1 for s in specs):
        raise PlanError(
            f"--schedule {schedule} lays {virtual} stages on each GPU: give a multiple of {virtual} stages "
            f"of one device each, got {len(specs)}"
        )
    check_layout(schedule, len(specs) // virtual, virtual, m)
    return layout_specs(schedule, [s.nodes for s in specs], len(specs) // virtual)


def _check_closed(profile: Profile, specs: Sequence[StageSpec]) -> None:
    where = {nid: i for i, s in enumerate(specs) for nid in s.nodes}
    for node in profile.nodes:
        for src in node.inputs:
            if where.get(src, 0) > where.get(node.id, 0):
                raise PlanError(f"layer {node.id} would run before its input {src}: cuts break the graph")


def alternatives(
    profile: Profile, cluster: Cluster, schedule: str, m: int, optimizer: str, recompute: str = "none"
) -> dict[str, Plan | None]:
    """The plans other tools would pick, each under the same ``recompute`` mode (None where it does
    not fit in memory): data parallelism; DeepSpeed's parameter and uniform partitioning and
    torchgpipe's time balancing, each with the data-parallel width its users would pick (the fastest
    that fits, one GPU per stage included); and the best plan without replication."""
    profile = priced_profile(profile, schedule, model(schedule).microbatches(m))
    free = replace(cluster, memory_bytes=None)
    args = (profile, cluster if recompute == "none" else free, schedule, m, optimizer)

    def fixed(plan: Plan) -> Plan:  # fixed stages: priced with the recompute mode where it applies
        return plan if recompute == "none" else repriced(profile, cluster, plan, recompute, True)

    def widest(make: Callable[..., Plan]) -> Plan:  # the fastest data-parallel width
        return best_width(lambda width: fixed(make(*args, width=width)), cluster.gpus)

    makers: dict[str, Callable[[], Plan]] = {
        "data parallel": lambda: fixed(data_parallel(*args)),
        "parameter balanced": partial(widest, parameter_balanced),
        "time balanced": partial(widest, time_balanced),
        "uniform layers": partial(widest, uniform),
        "best straight": lambda: solve(
            profile, cluster, schedule, m, optimizer, straight=True, recompute=recompute
        ),
    }
    return {name: fastest([make]) for name, make in makers.items()}
