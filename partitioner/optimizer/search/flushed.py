"""The synchronous time, minimised: the search for a flushing schedule (``1f1b``, ``gpipe``, ``zb1p``),
exact where ``sync`` can prove its plan, else the best of it and bubble-aware candidates
(docs/optimizer-search.md)."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import numpy as np

from partitioner.errors import InfeasibleError
from partitioner.graph import Profile
from partitioner.optimizer.options import SolveOptions
from partitioner.optimizer.pricing.memory import MemoryLimit
from partitioner.optimizer.pricing.price import assemble, layer_compute_s
from partitioner.optimizer.pricing.schedules import held_by_depth, model
from partitioner.optimizer.search.bottleneck import replica_cap, slowest_stage
from partitioner.optimizer.search.candidates import data_parallel, parameter_balanced, time_balanced, uniform
from partitioner.optimizer.search.plans import fastest, stage_specs, thin_states
from partitioner.optimizer.search.recomputing import recomputing_of
from partitioner.optimizer.search.states import StateSet
from partitioner.optimizer.search.sync import MAX_CHOICES, MAX_STEPS, Placed, placed_terms, solve_synchronous
from partitioner.plan import Cluster, Plan, SolverInfo

__all__ = [
    "PLACED_CELLS",
    "SYNC_CANDIDATE_STATES",
    "recomputing_applies",
    "solve_flushed",
    "solve_recomputing",
]

SYNC_CANDIDATE_STATES = 1000  # 1f1b/gpipe candidates each run a bottleneck search: thin beyond this
PLACED_CELLS = 20_000_000  # pairs x depths x device counts the depth-aware memory search may table


def solve_flushed(
    profile: Profile, cluster: Cluster, states: StateSet, opts: SolveOptions
) -> tuple[Plan, float, bool]:
    """The fastest plan found: (plan, lower bound, proven optimal over every downset)."""
    m, straight, comm = opts.m, opts.straight, opts.activation_comm
    gpus = cluster.gpus
    powers = sorted({1, *(2**i for i in range(int(math.log2(gpus)) + 1)), gpus})
    info = SolverInfo("dp", 0.0, False)
    exact = _exact(profile, cluster, states, opts)
    if exact is not None and exact[2]:
        return exact
    if len(states) > SYNC_CANDIDATE_STATES:  # candidates and the exact search on fewer cuts
        most = int(math.sqrt(2 * MAX_CHOICES / (1 if straight else gpus)))
        thin = thin_states(profile, min(most, SYNC_CANDIDATE_STATES), comm)
        states = replace(thin, stage_s=states.stage_s)
        if exact is None:
            exact = _exact(profile, cluster, states, opts)

    def bottleneck(where: Cluster, floor: int, line: bool) -> Plan:
        _, segments, _ = slowest_stage(profile, where, states, replace(opts, straight=line), floor)
        specs = stage_specs(profile, states, segments)
        return assemble(profile, cluster, specs, opts.schedule, m, opts.optimizer, info, activation_comm=comm)

    floors = [] if straight else [1] if len(cluster.levels) > 1 else powers  # hierarchies ignore floors
    makers = [partial(bottleneck, cluster, floor, False) for floor in floors]
    for units in powers:
        flat = Cluster.flat(units, cluster.levels[0].link, cluster.memory_bytes)
        makers.append(partial(bottleneck, flat, 1, True))
    baselines = [uniform, parameter_balanced, time_balanced] + ([] if straight else [data_parallel])
    makers += [partial(make, profile, cluster, opts.schedule, m, opts.optimizer) for make in baselines]
    widths = [] if straight else [w for w in range(2, gpus) if gpus % w == 0]  # with data parallelism
    makers += [partial(make, profile, cluster, opts.schedule, m, opts.optimizer, width=w)
               for make in (uniform, parameter_balanced, time_balanced) for w in widths]  # fmt: skip
    best = fastest(makers)
    bound = layer_compute_s(profile) / cluster.gpus
    if exact is not None and (
        best is None or exact[0].predicted.time_per_minibatch_s <= best.predicted.time_per_minibatch_s
    ):
        return exact[0], max(exact[1], bound), False
    if best is None:
        raise InfeasibleError("no plan fits in memory")
    return best, max(exact[1] if exact else 0.0, bound), False


def _exact(
    profile: Profile, cluster: Cluster, states: StateSet, opts: SolveOptions
) -> tuple[Plan, float, bool] | None:
    """The branch-and-bound optimum on one level (``sync``), when it is small enough to run: (plan,
    lower bound valid for every plan, proven optimal over all downsets)."""
    sched, m = model(opts.schedule), opts.m
    cap, steps, memory, placed = _limits(profile, cluster, states, opts)
    info = SolverInfo("dp", 0.0, False)
    for held in (None, memory) if memory is not None else (None,):  # unlimited first: often fits
        found = solve_synchronous(states, cluster.gpus, cluster.slowest, m, cap, steps, held, placed)
        if found is None:
            return None
        value, segments, lower = found
        try:
            plan = assemble(profile, cluster, stage_specs(profile, states, segments), opts.schedule, m,
                            opts.optimizer, info, activation_comm=opts.activation_comm)  # fmt: skip
        except InfeasibleError:
            continue
        if len(cluster.levels) > 1:  # searched at the slowest link: neither optimal nor a bound
            return plan, 0.0, False
        # it minimises the synchronous sum under a limit on what each stage holds (all M
        # microbatches, or as many as its depth lets in flight): its optimum and bound are the
        # schedule's only where that is the schedule's time and memory model
        sound = states.exact and (held is None or sched.holds_all or placed is not None) and sched.sync_sum
        return plan, lower if sound else 0.0, sound and lower >= value * (1 - 1e-9)
    return None


def solve_recomputing(
    profile: Profile, cluster: Cluster, states: StateSet, opts: SolveOptions
) -> tuple[Plan, float, bool]:
    """The branch and bound under the memory limit with every stage priced keeping its activations
    and recomputing them (``recomputing``), the plan's stages then recomputing as ``price`` decides
    for ``opts.recompute`` (``auto``: where they do not fit otherwise; ``all``): (plan, lower bound,
    proven optimal over every downset). On one level, for a schedule whose time is the synchronous
    sum (on a hierarchy, at its slowest link: a candidate); the planner's other way for the rest
    (``planner.solve_with``).

    Raises:
        InfeasibleError: no plan fits, or the search cannot run here (more choices than it prices).
    """
    sched, m = model(opts.schedule), opts.m
    cap, steps, memory, placed = _limits(profile, cluster, states, opts)
    redo = recomputing_of(profile, states, every=opts.recompute == "all")
    found = solve_synchronous(states, cluster.gpus, cluster.slowest, m, cap, steps, memory, placed, redo)
    if found is None:
        raise InfeasibleError("no plan fits in memory, recomputing or not")
    value, segments, lower = found
    specs = stage_specs(profile, states, segments)
    plan = assemble(profile, cluster, specs, opts.schedule, m, opts.optimizer, SolverInfo("dp", 0.0, False),
                    activation_comm=opts.activation_comm, recompute=opts.recompute)  # fmt: skip
    # (a hierarchy: searched at its slowest link, a candidate only)
    sound = (
        states.exact
        and (sched.holds_all or placed is not None)
        and sched.sync_sum
        and len(cluster.levels) == 1
    )
    return plan, lower if sound else 0.0, sound and lower >= value * (1 - 1e-9)


def recomputing_applies(cluster: Cluster, opts: SolveOptions) -> bool:
    """Whether :func:`solve_recomputing` can search ``opts``' recomputation: under a memory limit,
    for a schedule whose time is the synchronous sum (exactly on one level; on a hierarchy, at its
    slowest link, a candidate)."""
    sched = model(opts.schedule)
    return (
        cluster.memory_bytes is not None and sched.sync_sum and not sched.laid_out
        and opts.recompute in ("all", "auto")
    )  # fmt: skip


def _limits(
    profile: Profile, cluster: Cluster, states: StateSet, opts: SolveOptions
) -> tuple[int, int, MemoryLimit | None, Placed | None]:
    """The branch and bound's replica cap, steps, memory limit and items by depth."""
    # never more replicas than GPUs: a larger cap (a minibatch's samples) only multiplies the choices
    # past what the branch and bound can finish (densenet121, 1F1B on 4 GPUs: not proven, 4.6% slower)
    cap = min(replica_cap(profile, opts) or cluster.gpus, cluster.gpus)
    steps = MAX_STEPS if states.exact else 60  # no proof to finish on a subset of the cuts
    if cluster.memory_bytes is None:
        return cap, steps, None, None
    memory = MemoryLimit.of(
        cluster.memory_bytes + 0.5, profile, opts.optimizer, opts.schedule, cluster.gpus, opts.m,
        cluster.cores is not None,
    )  # fmt: skip
    return cap, steps, memory, _placed(opts.schedule, cluster.gpus, states, cap, opts.m)


def _placed(schedule: str, units: int, states: StateSet, cap: int, m: int) -> Placed | None:
    """The items a replica holds by its stage's depth, where the schedule's model says they depend
    on it alone (``ScheduleModel.held_from_end``): to the most stages a plan can have (one a device,
    one a state). None elsewhere, or where the search's table of depths would exceed
    ``PLACED_CELLS``: the search then holds all M microbatches on every stage (cautious)."""
    if not model(schedule).held_from_end:
        return None
    held, later = held_by_depth(schedule, max(1, min(units, len(states) - 1)), cap, m)
    placed = placed_terms(np.array(held, dtype=np.float64), np.array(later, dtype=np.float64))
    if states.pair_count() * len(placed[0]) * max(units + 1, cap) > PLACED_CELLS:
        return None
    return placed
