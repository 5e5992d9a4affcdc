"""Sharded data parallelism's cost terms, written once (docs/layout-3d.md, "What the shard levels
mean"): the bytes a device keeps per weight byte at each level, the weights and gradients of the
units in use, and the collectives over the ``d`` copies, overlapped with a unit's compute up to that
compute and the rest exposed.

Every weight byte here is one device's (after tensor parallelism divided the split layers'). A
"unit" is one ``fully_shard`` call: a profile node with parameters. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.errors import PlanError
from partitioner.optimizer.pricing.memory import OPTIMIZER_STATE, persistent_factor
from partitioner.optimizer.pricing.tensor import ring_time
from partitioner.plan import SHARD_LEVELS, Cluster, Link

__all__ = ["Unit", "data_link", "per_byte", "per_call_exposed", "step_exposed", "units_in_use"]


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` unit of a stage as one device holds it: its weight bytes and one
    microbatch's forward and backward seconds (its collectives overlap these)."""

    weight_bytes: float
    forward_s: float
    backward_s: float


def data_link(cluster: Cluster, tensor: int, copies: int) -> Link:
    """The link a stage's data group crosses: its ``copies`` ranks lie ``tensor`` apart, so they
    span the first level whose units hold ``tensor * copies`` devices."""
    span = 1
    for level in cluster.levels:
        span *= level.devices
        if span >= tensor * copies:
            return level.link
    return cluster.levels[-1].link


def per_byte(shard: str, copies: int, optimizer: str, master: float) -> float:
    """Bytes a device keeps per weight byte at ``shard`` over ``copies`` (the table of
    docs/layout-3d.md): the weight W and gradient G (one weight byte each), the float32 master
    (``master`` bytes, :func:`~.memory.master_ratio`) and the optimizer's state S (kept in float32).
    ``none``: W + G + master + S (:func:`~.memory.persistent_factor`); ``optimizer``: W + G + the
    sharded parameter (the master under mixed precision, else a shard of W) + S, the last two over
    the copies; ``gradients``: G over the copies as well; ``full``: everything over the copies."""
    if shard not in SHARD_LEVELS:
        raise PlanError(f"unknown shard level {shard!r}; use {', '.join(SHARD_LEVELS)}")
    if shard == "none" or copies < 2:
        return persistent_factor(optimizer, master)
    state = OPTIMIZER_STATE[optimizer] * max(master, 1.0)
    sharded = (master if master else 1.0) + state  # the sharded parameter and the optimizer's state
    if shard == "optimizer":
        return 2.0 + sharded / copies
    if shard == "gradients":
        return 1.0 + (1.0 + sharded) / copies
    return (2.0 + sharded) / copies


def units_in_use(shard: str, largest: float) -> float:
    """Bytes beyond :func:`per_byte` a device holds at its peak: under ``gradients`` one unit's
    unsharded gradient, under ``full`` the unsharded weights of the unit computing and the one
    prefetched and one unit's gradient (``largest``: the largest unit's weight bytes)."""
    return {"gradients": largest, "full": 3.0 * largest}.get(shard, 0.0)


def _overlapped(message: float, compute: float) -> float:
    return max(0.0, message - compute)


def per_call_exposed(shard: str, unit: Unit, copies: int, link: Link) -> tuple[float, float]:
    """Seconds a unit's collectives add to each microbatch's forward and backward beyond the
    unit's compute: ``gradients`` reduce-scatters the gradient in every backward, ``full`` also
    all-gathers the weights in every forward and backward; other levels add nothing per call."""
    if copies < 2 or shard in ("none", "optimizer"):
        return 0.0, 0.0
    gather = ring_time(unit.weight_bytes, copies, link)
    scatter = ring_time(unit.weight_bytes, copies, link)
    if shard == "gradients":
        return 0.0, _overlapped(scatter, unit.backward_s)
    return _overlapped(gather, unit.forward_s), _overlapped(gather + scatter, unit.backward_s)


def step_exposed(shard: str, units: Sequence[Unit], copies: int, link: Link) -> float:
    """Seconds a stage's data group adds once per minibatch (at its step): ``none`` all-reduces
    the gradients after the last backward (today's bucketed all-reduce, all exposed); the sharded
    levels always expose the first unit's all-gather and the last unit's reduce-scatter;
    ``optimizer`` and ``gradients`` the rest of their one all-gather beyond each unit's first
    forward, and ``optimizer`` the rest of its one reduce-scatter beyond each unit's last backward."""
    if copies < 2 or not units:
        return 0.0
    if shard == "none":
        return ring_time(sum(u.weight_bytes for u in units), copies, link, 2.0)
    first = ring_time(units[0].weight_bytes, copies, link)
    last = ring_time(units[-1].weight_bytes, copies, link)
    if shard == "full":
        return first + last
    gathers = sum(_overlapped(ring_time(u.weight_bytes, copies, link), u.forward_s) for u in units[1:])
    if shard == "gradients":  # (its reduce-scatters run in every backward: per_call_exposed)
        return first + last + gathers
    scatters = sum(_overlapped(ring_time(u.weight_bytes, copies, link), u.backward_s) for u in units[:-1])
    return first + last + gathers + scatters
