"""The 3D search: one layout (``t`` tensor ranks x ``d`` copies, a shard level) for every stage of
the plan, chosen jointly with the cuts, the schedule, the microbatches and recomputation.

For each layout the exact 2D search of one device per stage runs on its copy view
(:mod:`partitioner.optimizer.pricing.layout`), at every schedule and microbatch count; the
layouts are searched in the order of a lower bound on their time (a copy's work spread evenly
over its devices, no bubble, no step) and a layout whose bound is no better than the best plan
found, or whose weights alone cannot fit (their persistent bytes over the stages exceed the
memory), is ruled out before it is searched. Exact under the model within each layout but for
the step, which the search does not minimise: the plan keeps the search's bound, so its gap says
how far it can be. ``t = 1`` with ``shard = none`` is today's 2D search, which also lets each
stage have its own replicas (docs/optimizer-search.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile
from partitioner.optimizer.options import SolveOptions
from partitioner.optimizer.planner import solve_with
from partitioner.optimizer.pricing.layout import Layout, copy_cluster, copy_memory, copy_profile, layout_plan
from partitioner.optimizer.pricing.memory import master_ratio, persistent_factor
from partitioner.optimizer.pricing.schedules import MODELS, model
from partitioner.optimizer.pricing.simulate import Simulation, simulate
from partitioner.optimizer.pricing.tensor import degrees
from partitioner.plan import SHARD_LEVELS, Cluster, Plan

__all__ = ["LayoutChoice", "copy_of", "layouts", "simulate_layout", "solve_layout", "solve_layouts"]

#: schedules a 3D layout runs: every flushing one (pipedream's weight stashing takes t = 1 and no
#: sharding: docs/layout-3d.md).
LAYOUT_SCHEDULES: tuple[str, ...] = tuple(name for name, m in MODELS.items() if not m.asynchronous)


@dataclass(frozen=True)
class LayoutChoice:
    """The fastest 3D plan and, per layout tried, its best time (None: nothing fits; absent:
    ruled out by its bound)."""

    plan: Plan
    times: dict[str, float | None]


def layouts(
    profile: Profile, cluster: Cluster, tensor: int | None = None, shard: str | None = None
) -> list[Layout]:
    """Every layout of the cluster's devices: ``t`` among :func:`~.tensor.degrees` (or ``tensor``),
    ``d`` with ``t x d`` tiling the levels and splitting the batch, each shard level (or
    ``shard``) where ``d >= 2``; not ``t = 1`` unsharded (the 2D search's)."""
    inner = cluster.levels[0].devices
    ts = (tensor,) if tensor else degrees(profile, inner)
    if tensor and (inner % tensor or tensor not in degrees(profile, inner)):
        raise PlanError(
            f"--tensor-parallel {tensor} must divide a node's {inner} devices and every split layer's "
            f"degree (the profile allows {', '.join(map(str, degrees(profile, inner)))})"
        )
    shards = (shard,) if shard else SHARD_LEVELS
    batch = profile.batch_size or 0
    found = []
    for t in ts:
        for d in range(1, cluster.gpus // t + 1):
            if cluster.gpus % (t * d) or (batch and batch % d) or not _tiles(cluster, t * d):
                continue
            for s in shards:
                if (s != "none" and d < 2) or (t == 1 and s == "none" and not tensor):
                    continue
                found.append(Layout(t, d, s))
    return found


def _tiles(cluster: Cluster, group: int) -> bool:
    for level in cluster.levels:
        if group >= level.devices:
            if group % level.devices:
                return False
            group //= level.devices
        else:
            return level.devices % group == 0
    return group == 1


def _counts(batch: int, devices: int, asked: int | None) -> tuple[int, ...]:
    """Microbatches per copy: ``asked``, or the powers of two that split its batch, up to 4 a device."""
    if asked:
        return (asked,)
    top = min(batch, 4 * max(devices, 1))
    return tuple(1 << k for k in range(top.bit_length()) if (1 << k) <= top and batch % (1 << k) == 0)


def _bound(profile: Profile, cluster: Cluster, layout: Layout, optimizer: str) -> tuple[float, bool]:
    """(a lower bound on the layout's time: one copy's work at one microbatch over its stages'
    devices; whether its weights can fit at all: their persistent bytes over the stages)."""
    stages = cluster.gpus // layout.group
    view, _ = copy_profile(profile, cluster, layout, 1, optimizer)
    work = sum(n.forward_ms + n.backward_ms for n in view.nodes) / 1e3
    per_byte = persistent_factor(optimizer, master_ratio(view.dtype))
    persistent = sum(n.param_bytes for n in view.nodes) * per_byte
    fits = cluster.memory_bytes is None or persistent / max(stages, 1) <= cluster.memory_bytes
    return work / max(stages, 1), fits


def solve_layout(
    profile: Profile,
    cluster: Cluster,
    layout: Layout,
    opts: SolveOptions,
    schedules: Sequence[str] = LAYOUT_SCHEDULES,
    microbatches: int | None = None,
) -> Plan:
    """The fastest plan of ``layout`` over ``schedules`` and microbatch counts per copy
    (``microbatches``: the whole minibatch's, split over the copies).

    Raises:
        InfeasibleError: nothing fits.
    """
    batch = (profile.batch_size or layout.copies) // layout.copies
    stages = cluster.gpus // layout.group
    asked = microbatches // layout.copies if microbatches and microbatches % layout.copies == 0 else None
    best: Plan | None = None
    for m in _counts(batch, stages, asked):
        try:
            view, split = copy_profile(profile, cluster, layout, m, opts.optimizer)
            wide = copy_memory(cluster, split, layout)
        except PlanError:
            continue
        for schedule in schedules:
            sched = model(schedule)
            if sched.asynchronous:
                continue
            for virtual in sched.auto_virtual:
                at = replace(opts, schedule=schedule, microbatches=m, virtual_stages=virtual, straight=True)
                try:
                    copy = solve_with(view, wide, at.checked(view))
                except (InfeasibleError, PlanError):
                    continue
                plan = layout_plan(copy, split, cluster, layout)
                if best is None or _time(plan) < _time(best):
                    best = plan
    if best is None:
        raise InfeasibleError(f"no plan of layout {layout.describe()} fits")
    return best


def _time(plan: Plan) -> float:
    return plan.predicted.time_per_minibatch_s


def solve_layouts(
    profile: Profile,
    cluster: Cluster,
    opts: SolveOptions,
    schedules: Sequence[str] = LAYOUT_SCHEDULES,
    tensor: int | None = None,
    shard: str | None = None,
    microbatches: int | None = None,
    incumbent: float = float("inf"),
) -> LayoutChoice | None:
    """The fastest 3D plan over :func:`layouts` (module docstring); None: no layout beats
    ``incumbent`` (the 2D plan's time) or fits."""
    start = time.perf_counter()
    ranked = []
    for layout in layouts(profile, cluster, tensor, shard):
        bound, fits = _bound(profile, cluster, layout, opts.optimizer)
        if fits:
            ranked.append((bound, layout))
    ranked.sort(key=lambda x: x[0])
    best: Plan | None = None
    times: dict[str, float | None] = {}
    for bound, layout in ranked:
        if bound >= min(incumbent, _time(best) if best else incumbent):
            break
        try:
            plan = solve_layout(profile, cluster, layout, opts, schedules, microbatches)
        except InfeasibleError:
            times[layout.describe()] = None
            continue
        times[layout.describe()] = _time(plan)
        if best is None or _time(plan) < _time(best):
            best = plan
    if best is None:
        return None
    info = replace(best.solver, solve_time_s=time.perf_counter() - start)
    extra = {**best.extra, "layouts_searched": times, "layouts_ruled_out": len(ranked) - len(times)}
    return LayoutChoice(replace(best, solver=info, extra=extra), times)


def copy_of(plan: Plan, profile: Profile) -> tuple[Plan, Profile]:
    """One copy's 2D plan and its copy view, from a 3D plan (what :func:`simulate_layout` plays)."""
    info = plan.extra["layout"]
    layout = Layout(int(info["tensor_parallel"]), int(info["data_parallel"]), str(info["shard"]))
    m = plan.microbatches // layout.copies
    view, _ = copy_profile(profile, plan.cluster, layout, m, plan.optimizer)
    stages = tuple(
        replace(s, replicas=1, tensor_parallel=1, shard="none", ranks=(i,)) for i, s in enumerate(plan.stages)
    )
    copy = replace(plan, gpus=len(stages), cluster=copy_cluster(plan.cluster, layout), stages=stages,
                   microbatches=m, batch_size=view.batch_size)  # fmt: skip
    return copy, view


def simulate_layout(plan: Plan, profile: Profile) -> Simulation:
    """The simulation of a plan: a 3D plan's is one copy's pipeline (its step is in the plan's time)."""
    if "layout" not in plan.extra:
        return simulate(plan, profile)
    copy, view = copy_of(plan, profile)
    return simulate(copy, view)
