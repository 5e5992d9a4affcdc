"""What one stage costs, written once: every search, the plan's price and the simulation call these,
on numbers or numpy arrays alike (the terms: docs/optimizer-pricing.md). A search may invert them
(the fewest replicas under a time), which is its own algebra; it never prices a stage another way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from partitioner.plan import Link

__all__ = [
    "W_SHARE",
    "FloatArray",
    "IntArray",
    "Link",
    "StageLoad",
    "StagePrice",
    "StageTimes",
    "activation_time",
    "allreduce_time",
    "host_bound",
    "microbatch_compute",
    "microbatch_link",
    "microbatch_time",
    "stage_time",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
Real = TypeVar("Real", float, FloatArray)  # a number, or numbers elementwise

#: the share of a layer's backward time that is its weight gradient (W), the rest being its input
#: gradient (B), where the profile did not time the two apart (``Node.split_ms``; profiles written
#: before it, or with ``--no-fixed-cost``): the zero-bubble paper's T_B = T_W for transformer layers,
#: where both are one matrix product of the same size per linear layer (dX = dY W^T, dW = X^T dY).
#: A measured split replaces it (``StageLoad.weight_s``): element-wise layers have no W.
W_SHARE = 0.5


@dataclass(frozen=True)
class StageLoad:
    """What one stage carries, for one minibatch of the profile's batch size.

    Attributes:
        compute_s: forward+backward seconds of its layers on one device.
        param_bytes: parameter bytes of its layers.
        saved_bytes: activation bytes its layers keep for backward.
        in_bytes: activation bytes it receives from earlier stages (0 for the first stage).
        out_bytes: activation bytes it sends to later stages (0 for the last stage).
        forward_s: forward seconds of its layers on one device (what recomputation repeats); None: a
            third of ``compute_s`` (backward twice forward).
        input_bytes: bytes of every tensor its forward takes (the model's inputs on the first
            stage, relayed tensors included): what a recomputing stage keeps per item in flight.
            Unlike ``in_bytes`` it is never zeroed for cut pricing.
        master: bytes of float32 master weights per weight byte (``memory.master_ratio``: 2 for
            bfloat16 weights, 0 for float32).
        copy_bytes: bytes of the tied weights it holds a copy of (``memory.copy_bytes``): memory only,
            their gradients' sync is not priced.
        largest_param_bytes: the most gradient bytes one of its layers' backwards makes at once
            (``memory.made_at_once``: its largest weight's; a tied copy counted): the gradient a
            replica that accumulates holds beside the sum.
        working_bytes: what one item's backward holds beyond the saved bytes, held once per
            device: :func:`~partitioner.optimizer.pricing.memory.backward_excess` of its layers
            (the loss's on the last stage too), at most the largest of their ``working_bytes``.
        deferred_bytes: what a split backward keeps from an item's B to its W, per minibatch: its
            layers' ``deferred_bytes``; on the first stage, whose B has no input gradient to make
            (W runs its whole backward), the gradient it received, kept for W.
        kept_bytes: the part of ``saved_bytes`` a recomputing stage keeps per item all the same: the
            loss's (the output node's; ``runtime.executing.stage`` runs the loss outside the recomputed
            forward, so a cross-entropy's log-softmax is saved for every microbatch in flight).
        sent_bytes: what it sends on per minibatch that the producing layer's backward does not keep
            (``Node.kept_output_bytes``): held per item until its backward as autograd's roots.
        received_bytes: what it receives per minibatch that the producing layer keeps: counted in
            that layer's saved bytes on the stage before, and held here as a copy per item.
        posted_bytes: on CPU ranks (gloo), the receive posted one receiving action ahead
            (``runtime.executing.comm``): the larger of what it receives and what it is sent back per
            minibatch, one item's held once per device beside the working bytes; 0 on GPUs.
        weight_s: under a split backward, the W part of its backward seconds (its layers' measured
            ``Node.split_ms``; on the first stage, whose B has no input gradient to make, all of it);
            None: not measured, W is :data:`W_SHARE` of the backward.
    """

    compute_s: float
    param_bytes: float
    saved_bytes: float
    in_bytes: float
    out_bytes: float
    forward_s: float | None = None
    input_bytes: float = 0.0
    copy_bytes: float = 0.0
    largest_param_bytes: float = 0.0
    master: float = 0.0
    working_bytes: float = 0.0
    kept_bytes: float = 0.0
    deferred_bytes: float = 0.0
    sent_bytes: float = 0.0
    received_bytes: float = 0.0
    posted_bytes: float = 0.0
    weight_s: float | None = None

    def weight_share(self, recompute: bool = False) -> float:
        """W's part of one backward as the stage runs it (a recomputing stage's B reruns the
        forward first): measured where ``weight_s`` is, else :data:`W_SHARE`."""
        backward = self.compute_s - self.forward_time * (not recompute)
        if self.weight_s is None or backward <= 0:
            return W_SHARE
        return min(1.0, self.weight_s / backward)

    @property
    def item_bytes(self) -> float:
        """What it holds per minibatch of items in flight: its layers' saved bytes and the tensors at
        its edges no layer's count covers (``StateSet.item_bytes`` in the searches)."""
        return self.saved_bytes + self.sent_bytes + self.received_bytes

    @property
    def forward_time(self) -> float:
        """Forward seconds: ``forward_s``, or a third of ``compute_s`` where not measured."""
        return self.compute_s / 3.0 if self.forward_s is None else self.forward_s

    @property
    def forward_share(self) -> float:
        """The forward's part of ``compute_s``."""
        if self.compute_s <= 0:
            return 1.0 / 3.0
        return self.forward_time / self.compute_s


@dataclass(frozen=True)
class StagePrice:
    """A stage's cost on one device: compute seconds per minibatch (recomputation included, before
    dividing by replicas) and peak memory bytes."""

    compute_s: float
    memory_bytes: int


@dataclass(frozen=True)
class StageTimes:
    """Per-stage times of a plan and the resulting time per minibatch."""

    compute_s: tuple[float, ...]
    comm_s: tuple[float, ...]
    stage_s: tuple[float, ...]
    time_per_minibatch_s: float
    bubble_fraction: float


def activation_time(nbytes: Real, replicas: Real | int, link: Link) -> Real:
    """PipeDream's charge for activations crossing a cut: forward send plus backward gradient, each
    one message of ``nbytes`` (none where nothing crosses); a replica carries every r-th minibatch."""
    return 2.0 * nbytes / (link.bandwidth * replicas) + 2.0 * link.latency * (nbytes > 0) / replicas


def allreduce_time(param_bytes: Real, replicas: Real | int, link: Link, inner: int = 1) -> Real:
    """Gradient synchronisation of a replicated stage: PipeDream's 4(r-1)P/(rB) volume (over
    ``inner``, the devices of one unit that share it) and a ring's 2(r-1) steps, each one message,
    at the link's all-reduce figures (:attr:`Link.sync_bandwidth`, :attr:`Link.sync_latency`)."""
    steps = replicas - 1
    return (
        4.0 * steps * param_bytes / (link.sync_bandwidth * replicas) / inner + 2.0 * steps * link.sync_latency
    )


def stage_time(
    compute: FloatArray | float,
    params: FloatArray | float,
    replicas: FloatArray | int,
    link: Link,
    inner: int = 1,
    act: FloatArray | float = 0.0,
) -> FloatArray:
    """A pipedream stage's time on ``replicas``: max((C + sync)/r, cut traffic), with sync
    :func:`allreduce_time` and ``act`` the larger of the traffic into and out of the stage (0:
    compute and sync only)."""
    r = np.asarray(replicas, dtype=np.float64)
    busy = (np.asarray(compute) + allreduce_time(np.asarray(params), r, link, inner)) / r
    return np.asarray(np.maximum(busy, activation_time(np.asarray(act), r, link)), dtype=np.float64)


def microbatch_compute(compute: Real, replicas: Real | int, microbatches: int) -> Real:
    """A microbatch's compute on one replica of a synchronous stage: C/(r·M)."""
    return compute / (replicas * microbatches)


def microbatch_link(out_bytes: Real, replicas: Real | int, microbatches: int, link: Link) -> Real:
    """A microbatch's cut traffic after a synchronous stage, out and back: its share of the bytes,
    and a message each way whatever its size (each microbatch sends its own)."""
    share = 2.0 * out_bytes / (link.bandwidth * replicas) / microbatches
    return share + 2.0 * link.latency * (out_bytes > 0)


def microbatch_time(
    compute: Real, out_bytes: Real, replicas: Real | int, microbatches: int, link: Link
) -> Real:
    """A microbatch's time on a synchronous stage: its compute share and its cut traffic."""
    return microbatch_compute(compute, replicas, microbatches) + microbatch_link(
        out_bytes, replicas, microbatches, link
    )


def host_bound(rank_compute_s: Sequence[float], per_host: int, cores: int | None, threads: int) -> float:
    """Seconds per minibatch the busiest host needs where devices are CPU processes (0 for GPUs): ranks
    sharing a host's cores run at most ``cores / threads`` at once; ``rank_compute_s[r]``: rank r's."""
    if cores is None or not rank_compute_s:
        return 0.0
    at_once = max(1.0, min(float(per_host), cores / threads))
    hosts = range(0, len(rank_compute_s), per_host)
    return max(sum(rank_compute_s[h : h + per_host]) for h in hosts) / at_once
