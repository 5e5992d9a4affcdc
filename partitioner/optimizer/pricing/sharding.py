"""Sharded data parallelism's cost terms, written once (docs/layout-3d.md, "What the shard levels
mean"): the bytes a device keeps per weight byte at each level, the weights and gradients of the
units in use, and the collectives over the ``d`` copies, all exposed.

Every weight byte here is one device's (after tensor parallelism divided the split layers'). A
"unit" is one ``fully_shard`` call, and the runtime's is the whole stage
(``runtime/executing/sharding.py``: the generated stage reads its weights directly, so FSDP2's hooks
sit on the stage): what the units in use hold is a share of the stage's own weight bytes
(:func:`per_byte`, :func:`step_bytes`), and a stage's all-gather has no compute of its own stage to
hide behind (:func:`per_call_exposed`, :func:`step_exposed`).
Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from partitioner.errors import PlanError
from partitioner.optimizer.pricing.memory import BUCKET_BYTES, OPTIMIZER_STATE, persistent_factor
from partitioner.optimizer.pricing.tensor import ring_time
from partitioner.plan import SHARD_LEVELS, Cluster, Link

__all__ = ["data_link", "per_byte", "per_call_exposed", "step_bytes", "step_exposed"]


def data_link(cluster: Cluster, tensor: int, copies: int) -> Link:
    """The link a stage's data group crosses: its ``copies`` ranks lie ``tensor`` apart, so they
    span the first level whose units hold ``tensor * copies`` devices."""
    span = 1
    for level in cluster.levels:
        span *= level.devices
        if span >= tensor * copies:
            return level.link
    return cluster.levels[-1].link


def _sharded(copies: int, optimizer: str, master: float) -> float:
    """The sharded parameter (the float32 master under mixed precision, else a shard of W) and
    the optimizer's state, per weight byte, over the copies."""
    return ((master if master else 1.0) + OPTIMIZER_STATE[optimizer] * max(master, 1.0)) / copies


def per_byte(shard: str, copies: int, optimizer: str, master: float) -> float:
    """Bytes a device keeps per weight byte of its stage while the stage computes (the table of
    docs/layout-3d.md): the weight W and gradient G (one weight byte each), the float32 master
    (``master`` bytes, :func:`~.memory.master_ratio`) and the optimizer's state S (float32).
    ``none``: W + G + master + S (:func:`~.memory.persistent_factor`); ``optimizer``: the unsharded
    W and G the minibatch keeps + the sharded parameter and S over the copies; ``gradients`` and
    ``full``: the same and the sharded gradient over the copies. The stage is one unit, so under
    ``gradients`` its whole gradient is unsharded while its backward runs, and under ``full`` its
    whole weights and gradient: both hold what ``gradients`` holds."""
    if shard not in SHARD_LEVELS:
        raise PlanError(f"unknown shard level {shard!r}; use {', '.join(SHARD_LEVELS)}")
    if shard == "none" or copies < 2:
        return persistent_factor(optimizer, master)
    if shard == "optimizer":
        return 2.0 + _sharded(copies, optimizer, master)
    return 2.0 + 1.0 / copies + _sharded(copies, optimizer, master)


def step_bytes(shard: str, copies: int, optimizer: str, master: float, weight: float, copied: bool) -> float:
    """Bytes a device of a stage of ``weight`` bytes holds while its data group sums the gradients
    after the minibatch's last backward (activations gone; the plan's peak where this is above the
    backward's). ``none``: its persistent bytes and one bucket's flat copy
    (:func:`~.memory.allreduce_bytes`). The shard levels, FSDP2's reduce-scatter of the stage's
    one unit: the unsharded W (still gathered), the sharded parameter and S, the flat input G
    FSDP2 copies the gradients into (they are freed once copied) and its output G/d, under
    ``gradients`` and ``full`` the sharded gradient the earlier microbatches summed (G/d); and,
    ``copied`` (CPU ranks: gloo's reduce-scatter works on a whole copy of its input), one more G."""
    if copies < 2:
        return 0.0
    if shard == "none":
        return weight * persistent_factor(optimizer, master) + min(BUCKET_BYTES, weight)
    held = 2.0 + 1.0 / copies + _sharded(copies, optimizer, master) + (1.0 if copied else 0.0)
    return weight * (held + (1.0 / copies if shard != "optimizer" else 0.0))


def per_call_exposed(shard: str, weight_bytes: float, copies: int, link: Link) -> tuple[float, float]:
    """Seconds a node's share (its ``weight_bytes`` on one device) of its stage's collectives adds to each
    microbatch's forward and backward: ``gradients`` reduce-scatters the gradient in every backward,
    ``full`` also all-gathers the weights in every forward and backward; other levels add nothing per
    call. Nothing overlaps: the runtime's unit is the whole stage (``runtime/executing/sharding.py``),
    whose all-gather ends before its compute starts and whose reduce-scatter starts after its backward.
    Bytes only: the stage's one latency a call is left out (docs/limits.md)."""
    if copies < 2 or shard in ("none", "optimizer"):
        return 0.0, 0.0
    wire = ring_time(weight_bytes, copies, replace(link, latency=0.0, allreduce_latency=0.0))
    return (0.0, wire) if shard == "gradients" else (wire, 2.0 * wire)


def step_exposed(shard: str, weights: Sequence[float], copies: int, link: Link) -> float:
    """Seconds a stage's data group (its nodes' ``weights`` on one device) adds once per minibatch (at its
    step), none of it overlapped (the stage is one unit: :func:`per_call_exposed`): ``none`` all-reduces
    the gradients after the last backward (today's bucketed all-reduce); ``optimizer`` all-gathers the
    weights before the first forward and reduce-scatters the gradients after the last backward;
    ``gradients`` its one all-gather (its reduce-scatters run in every backward); ``full`` nothing
    beyond its calls'."""
    if copies < 2 or not weights:
        return 0.0
    weight = sum(weights)
    if shard == "none":
        return ring_time(weight, copies, link, 2.0)
    once = ring_time(weight, copies, link)
    return {"optimizer": 2.0 * once, "gradients": once}.get(shard, 0.0)
