"""Tensor parallelism's cost terms, written once (docs/layout-3d.md, "What tensor parallelism means").

A split node (``Node.tp_max`` > 0, divisible by ``t``) runs on ``t`` devices at once: its split
parameters (``tp_param_bytes``) and its saved, working and deferred bytes are divided by ``t``,
its compute is divided by ``t`` and multiplied by the device model's penalty for the smaller matrix
products (:func:`split_penalty`), and each microbatch all-reduces ``tp_comm_bytes`` (its share of
them) over the tensor group in the forward and the same again in the backward. Every other node is
replicated inside the group: whole parameters, whole compute, whole activations. What crosses a
cut is whole on every tensor rank, so ``output_bytes`` is unchanged.

:func:`tensor_view` turns a profile into the profile one tensor rank runs; every 3D price goes
through it (:mod:`partitioner.optimizer.pricing.layout`). Pure Python, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from partitioner.graph import Node, Profile
from partitioner.hardware.devices import DeviceModel, estimated_device
from partitioner.plan import Link

__all__ = [
    "PRODUCTS_KEY",
    "TOKENS_KEY",
    "degrees",
    "ring_time",
    "split_penalty",
    "splittable",
    "tensor_view",
]

PRODUCTS_KEY = "tensor_parallel_products"
"""``profile.extra`` key: per node id, the FLOPs of each of its split matrix products for one
sample, forward (written where the shapes are known: estimated profiles of decoder layers). Absent:
a split layer's compute is divided by ``t`` exactly (no penalty known)."""


TOKENS_KEY = "tensor_parallel_tokens"
"""``profile.extra`` key beside :data:`PRODUCTS_KEY`: tokens in one sample (model FLOPs' count)."""


def splittable(node: Node, t: int) -> bool:
    """Whether tensor parallelism of degree ``t`` splits ``node`` (``t`` divides its ``tp_max``)."""
    return t > 1 and node.tp_max > 0 and node.tp_max % t == 0


def degrees(profile: Profile, node_devices: int) -> tuple[int, ...]:
    """The tensor-parallel degrees worth searching: ``t`` dividing a node's devices and the
    ``tp_max`` of every split node of the profile (one degree for the whole plan), 1 always."""
    maxima = [n.tp_max for n in profile.nodes if n.tp_max > 0]
    if not maxima:
        return (1,)
    common = math.gcd(node_devices, *maxima)
    return tuple(t for t in range(1, common + 1) if common % t == 0)


def ring_time(nbytes: float, ranks: int, link: Link, steps_per_rank: float = 1.0) -> float:
    """One ring collective over ``ranks`` devices: ``steps_per_rank`` (ranks - 1) / ranks of
    ``nbytes`` each way and as many latencies (all-gather, reduce-scatter: 1; all-reduce: 2), at
    the link's collective figures (``Link.sync_bandwidth``, ``Link.sync_latency``)."""
    if ranks < 2 or nbytes <= 0:
        return 0.0
    share = (ranks - 1) / ranks
    return steps_per_rank * (share * nbytes / link.sync_bandwidth + (ranks - 1) * link.sync_latency)


def split_penalty(device: DeviceModel | None, dtype: str, products: Sequence[float], t: int) -> float:
    """How much slower, per FLOP, the node's products run split ``t`` ways: the time of every
    product at ``1/t`` of its FLOPs over the time at its whole FLOPs, each at the device model's
    rate for its size (``DeviceModel.matmul_rate``); 1 without a device model or products."""
    if device is None or not products or t <= 1:
        return 1.0
    whole = sum(f / device.matmul_rate(dtype, f) for f in products if f > 0)
    split = sum(f / device.matmul_rate(dtype, f / t) for f in products if f > 0)
    return split / whole if whole > 0 else 1.0


def _split_node(node: Node, t: int, penalty: float, comm_ms: float, comm_fixed_ms: float) -> Node:
    """``node`` on one of ``t`` tensor ranks: its work beyond its fixed time per call divided by
    ``t`` and slowed by ``penalty``, its kernels' fixed time whole, its all-reduces added."""

    def timed(total: float, fixed: float) -> float:
        return (total - fixed) * penalty / t + fixed + comm_ms + comm_fixed_ms

    params = node.param_bytes - node.tp_param_bytes + node.tp_param_bytes / t
    # its largest weight on one rank: split (1/t of it), or among those kept whole
    largest = min(node.largest_tensor_bytes, max(node.param_bytes - node.tp_param_bytes,
                                                 node.largest_tensor_bytes / t))  # fmt: skip
    split_cast = node.cast_bytes * (node.tp_param_bytes / node.param_bytes) if node.param_bytes else 0.0
    return replace(
        node,
        forward_ms=timed(node.forward_ms, node.forward_fixed_ms),
        backward_ms=timed(node.backward_ms, node.backward_fixed_ms),
        forward_fixed_ms=node.forward_fixed_ms + comm_fixed_ms,
        backward_fixed_ms=node.backward_fixed_ms + comm_fixed_ms,
        param_bytes=round(params),
        largest_tensor_bytes=round(largest),
        cast_bytes=round(node.cast_bytes - split_cast + split_cast / t),
        saved_bytes=round(node.saved_bytes / t),
        working_bytes=round(node.working_bytes / t),
        deferred_bytes=round(node.deferred_bytes / t),
        kept_output_bytes=None if node.kept_output_bytes is None else round(node.kept_output_bytes / t),
    )


def tensor_view(profile: Profile, t: int, link: Link, microbatch_samples: float | None = None) -> Profile:
    """The profile one rank of a tensor group of ``t`` runs (module docstring).

    ``link``: the tensor group's (the cluster's innermost level). The all-reduces' bytes go on the
    node's time per minibatch, their latencies on its fixed time per call (one all-reduce per
    microbatch). ``microbatch_samples``: the samples of one microbatch, the size the products are
    priced at (None: the profile's batch, one microbatch).
    """
    if t <= 1:
        return profile
    device = estimated_device(profile)
    products: Mapping[str, Sequence[float]] = profile.extra.get(PRODUCTS_KEY, {})
    samples = microbatch_samples or float(profile.batch_size or 1)
    nodes = []
    for node in profile.nodes:
        if not splittable(node, t):
            nodes.append(node)
            continue
        sizes = [f * samples for f in products.get(node.id, ())]
        penalty = split_penalty(device, profile.dtype, sizes, t)
        wire = ring_time(node.tp_comm_bytes, t, link, 2.0)  # all-reduce: 2 (t-1)/t of the bytes
        fixed = 2.0 * (t - 1) * link.sync_latency
        nodes.append(_split_node(node, t, penalty, (wire - fixed) * 1e3, fixed * 1e3))
    extra = {**dict(profile.extra), "tensor_parallel": t}
    return replace(profile, nodes=tuple(nodes), extra=extra)
