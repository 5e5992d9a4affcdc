"""A 3D layout's price, written once: ``t`` tensor ranks x ``d`` copies of every stage, sharing at
one shard level (docs/layout-3d.md), priced as one copy's pipeline plus its data group's step.

With the same ``d`` on every stage, microbatch ``j`` goes to copy ``j mod d`` of every stage
(``Schedule.replica_of``), so the copies are ``d`` independent pipelines of ``M`` microbatches of
``B / (d M)`` samples each, which meet only at the step. One copy's pipeline is priced as a 2D
plan of one device per stage on the *copy view*: :func:`copy_profile` (what one tensor rank of one
copy runs: :func:`~.tensor.tensor_view`, ``1/d`` of the minibatch, the shard level's collectives
per microbatch beyond their units' compute, and its persistent bytes per weight byte) on
:func:`copy_cluster` (one device per ``t x d`` group). :func:`layout_plan` turns that plan into the
3D plan: each stage's ``t x d`` ranks, its data group's step (:func:`~.sharding.step_exposed`)
added to the time, and its memory at least what its data group's step holds
(:func:`~.sharding.step_bytes`). Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from partitioner.errors import PlanError
from partitioner.graph import Profile, at_microbatches
from partitioner.optimizer.pricing.memory import master_ratio, persistent_factor
from partitioner.optimizer.pricing.sharding import (
    data_link,
    per_byte,
    per_call_exposed,
    step_bytes,
    step_exposed,
)
from partitioner.optimizer.pricing.tensor import tensor_view
from partitioner.plan import SHARD_LEVELS, Cluster, Level, Plan

__all__ = ["Layout", "copy_cluster", "copy_memory", "copy_profile", "copy_weights", "layout_plan"]


@dataclass(frozen=True)
class Layout:
    """One plan's 3D layout: ``tensor`` ranks to a copy, ``copies`` copies of every stage, ``shard``."""

    tensor: int
    copies: int
    shard: str = "none"

    def __post_init__(self) -> None:
        if self.tensor < 1 or self.copies < 1:
            raise PlanError(f"a layout needs t >= 1 and d >= 1, got t={self.tensor}, d={self.copies}")
        if self.shard not in SHARD_LEVELS:
            raise PlanError(f"unknown shard level {self.shard!r}; use {', '.join(SHARD_LEVELS)}")
        if self.shard != "none" and self.copies < 2:
            raise PlanError(f"--shard {self.shard} needs at least 2 data-parallel copies")

    @property
    def group(self) -> int:
        """Devices of one stage: ``t x d``."""
        return self.tensor * self.copies

    def describe(self) -> str:
        """``TP8 x DP2 (optimizer)``."""
        shard = "" if self.shard == "none" else f" ({self.shard})"
        return f"TP{self.tensor} x DP{self.copies}{shard}"


def copy_cluster(cluster: Cluster, layout: Layout) -> Cluster:
    """The cluster of ``t x d`` groups, one device each (a group never splits a unit of a level
    it does not fill)."""
    group, levels = layout.group, []
    for level in cluster.levels:
        if group >= level.devices:
            if group % level.devices:
                raise PlanError(f"{layout.describe()} does not tile the cluster's levels")
            group //= level.devices
            continue
        if level.devices % group:
            raise PlanError(f"{layout.describe()} does not tile the cluster's levels")
        levels.append(replace(level, devices=level.devices // group))
        group = 1
    if not levels:  # one group: a level of one device
        levels = [Level(1, cluster.levels[-1].bandwidth, cluster.levels[-1].latency)]
    cores = None if cluster.cores is None else max(1, cluster.cores // layout.group)
    return replace(cluster, levels=tuple(levels), cores=cores)


def copy_profile(
    profile: Profile, cluster: Cluster, layout: Layout, microbatches: int, optimizer: str
) -> tuple[Profile, Profile]:
    """(the copy view, its split profile before the shard level's terms) of ``profile`` for
    ``layout`` at ``microbatches`` per copy (module docstring). The view has no fixed times left:
    each node already pays its ``microbatches`` calls.

    Raises:
        PlanError: the batch does not split into ``d`` copies of ``microbatches`` microbatches.
    """
    t, d, m = layout.tensor, layout.copies, microbatches
    batch = profile.batch_size or d * m
    if batch % (d * m):
        raise PlanError(f"a batch of {batch} does not split into {d} copies of {m} microbatches")
    split = tensor_view(profile, t, cluster.levels[0].link, batch / (d * m))
    whole = at_microbatches(split, d * m)  # d x m calls of one microbatch each ...
    nodes = tuple(
        replace(n, forward_ms=n.forward_ms / d, backward_ms=n.backward_ms / d,
                output_bytes=round(n.output_bytes / d), saved_bytes=round(n.saved_bytes / d),
                working_bytes=round(n.working_bytes / d), deferred_bytes=round(n.deferred_bytes / d),
                kept_output_bytes=None if n.kept_output_bytes is None else round(n.kept_output_bytes / d),
                tp_comm_bytes=round(n.tp_comm_bytes / d))
        for n in whole.nodes
    )  # fmt: skip  # ... of which one copy runs m
    extra = {**dict(whole.extra), "measured_batch_size": batch // d, "layout": layout.describe()}
    split = replace(whole, nodes=nodes, batch_size=batch // d, extra=extra)
    link = data_link(cluster, t, d)
    master = master_ratio(profile.dtype)
    scale = per_byte(layout.shard, d, optimizer, master) / persistent_factor(optimizer, master)
    view = []
    for n in split.nodes:
        fwd, bwd = (
            per_call_exposed(layout.shard, float(n.param_bytes), d, link) if n.param_bytes else (0.0, 0.0)
        )
        view.append(replace(n, forward_ms=n.forward_ms + m * fwd * 1e3,
                            backward_ms=n.backward_ms + m * bwd * 1e3,
                            param_bytes=round(n.param_bytes * scale),
                            largest_tensor_bytes=round(n.largest_tensor_bytes * scale)))  # fmt: skip
    return replace(split, nodes=tuple(view)), split


def copy_memory(cluster: Cluster, split: Profile, layout: Layout) -> Cluster:
    """:func:`copy_cluster` with the cluster's memory: what the units in use hold is in each
    node's weight bytes (the stage is the runtime's one unit: :func:`~.sharding.per_byte`), and a
    plan's step is checked on the plan (:func:`layout_plan`, ``memory_bytes``)."""
    del split  # (kept for the callers: the units no longer depend on the profile's largest node)
    return copy_cluster(cluster, layout)


def copy_weights(split: Profile, nodes: Sequence[str]) -> list[float]:
    """The weight bytes on one device of a stage's nodes with parameters (the runtime shards them
    as one ``fully_shard`` unit: :func:`~.sharding.step_exposed` sums them)."""
    by_id = {n.id: n for n in split.nodes}
    return [float(by_id[i].param_bytes) for i in nodes if i in by_id and by_id[i].param_bytes > 0]


def _step_bytes(
    copy: Plan, nodes: Sequence[str], weights: dict[str, float], layout: Layout, master: float
) -> float:
    """What one device of a stage of ``nodes`` holds at its data group's step (CPU ranks, a plan
    whose cluster counts host cores, run gloo: its reduce-scatter copies its input)."""
    weight = sum(weights.get(i, 0.0) for i in nodes)
    copied = copy.cluster.cores is not None
    return step_bytes(layout.shard, layout.copies, copy.optimizer, master, weight, copied)


def layout_plan(copy: Plan, split: Profile, cluster: Cluster, layout: Layout) -> Plan:
    """The 3D plan of one copy's pipeline ``copy`` (priced on the copy view of ``split``): each
    stage on the ``t x d`` ranks of its group (group ``g``: ranks ``g t d .. (g + 1) t d - 1``,
    data-major); its step's exposed collectives in its
    communication and, the slowest of them, in the time; the units in use in its memory. The
    search's lower bound stays a bound (the step only adds)."""
    link = data_link(cluster, layout.tensor, layout.copies)
    master = master_ratio(split.dtype)
    weights = {n.id: float(n.param_bytes) for n in split.nodes}
    stages, steps = [], []
    for s in copy.stages:  # (a laid-out schedule's copy keeps several stages on one group)
        step = step_exposed(layout.shard, copy_weights(split, s.nodes), layout.copies, link)
        ranks = tuple(range(s.ranks[0] * layout.group, (s.ranks[0] + 1) * layout.group))
        steps.append(step)
        stages.append(replace(
            s, replicas=layout.copies, tensor_parallel=layout.tensor, shard=layout.shard, ranks=ranks,
            compute_s=s.compute_s * layout.copies, comm_s=s.comm_s + step,
            memory_bytes=round(max(s.memory_bytes, _step_bytes(copy, s.nodes, weights, layout, master))),
        ))  # fmt: skip
    p = copy.predicted
    pipeline = (p.pipeline_s or p.time_per_minibatch_s) + max(steps, default=0.0)
    time = max(pipeline, p.host_bound_s)
    batch = (copy.batch_size or 0) * layout.copies or None
    predicted = replace(
        p, time_per_minibatch_s=time, pipeline_s=pipeline,
        throughput_samples_per_s=batch / time if batch and time > 0 else None,
        speedup_vs_data_parallel=None, speedup_vs_single=None,
    )  # fmt: skip
    extra = {
        **copy.extra, "layout": {"tensor_parallel": layout.tensor, "data_parallel": layout.copies,
                                  "shard": layout.shard, "pipeline": len(stages),
                                  "step_s": max(steps, default=0.0),
                                  "copy_time_s": copy.predicted.time_per_minibatch_s},
    }  # fmt: skip
    return replace(
        copy, gpus=len({r for s in stages for r in s.ranks}), cluster=cluster, stages=tuple(stages),
        predicted=predicted, batch_size=batch,
        extra=extra, microbatches=copy.microbatches * layout.copies,
    )  # fmt: skip
