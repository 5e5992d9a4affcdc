"""Each layer's times at the microbatch sizes a search considers, and its fixed time per call.

A layer's time is not proportional to its batch: every call pays launches, Python dispatch and
allocator work whatever its size. A minibatch split into M microbatches pays that M times, which is
what makes more microbatches slower past some count and what ``--schedule auto``'s microbatch
search weighs against the bubble. Two measurements, at the minibatch ``b`` and at ``s = b / 8``,
give each layer's line ``t(n) = fixed + n * per_sample``; :func:`partitioner.graph.at_microbatches`
then charges ``fixed`` once per microbatch.

The smaller batch is an eighth of the larger one because its noise enters the fit amplified by
``b / (b - s)`` (8/7 here, against 2 for a half) and an eighth is where small microbatches live.

The line misses the curve between its two points: small matrix products run at a lower efficiency
than large ones. On 8 x ``Linear(512, 512)`` + ReLU (one CPU thread) the line through 64 and 8
samples priced a call of 16 at 0.71 of its measured time (``pipeplan profile --batch-size 16``
against ``--batch-size 64``'s fixed times). So every layer is measured at each halving of the batch
down to the eighth (:func:`sizes_of`: the microbatches of 2, 4 and 8 per minibatch, the counts
``--schedule auto`` tries on a few ranks and the schedules' defaults), its backward also split into
B and W as zb1p and zbv run it, and ``Node.sized`` keeps them all (:mod:`partitioner.sized`
prices any size from them). The line stays: ``--schedule auto`` and older readers use it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch.fx as fx
from torch import Tensor

from partitioner.profiler.measure import LayerCost, LayerProfiler
from partitioner.profiler.trace import Group
from partitioner.sized import SizedCost

__all__ = ["estimate_sizes", "fit_fixed", "measure_fixed", "sized_entry", "sizes_of", "small_batch"]

log = logging.getLogger(__name__)


def small_batch(batch: int) -> int | None:
    """The second batch size: an eighth of ``batch``, at least 1; None for a batch of 1."""
    return max(1, batch // 8) if batch >= 2 else None


def sizes_of(batch: int) -> list[int]:
    """The smaller sizes measured besides ``batch``: its halvings down to :func:`small_batch`, largest
    first, each at least 1 sample ([] for a batch of 1)."""
    few = small_batch(batch)
    if few is None:
        return []
    return sorted({max(few, batch // 2**k) for k in (1, 2, 3)} - {batch}, reverse=True)


def sized_entry(samples: int, cost: LayerCost) -> SizedCost:
    """One measured size of a layer, as ``Node.sized`` keeps it."""
    return SizedCost(samples, cost.forward_ms, cost.backward_ms, cost.input_ms, cost.weight_ms)


def fit_fixed(big: LayerCost, small: LayerCost, batch: int, few: int) -> tuple[float, float]:
    """Fixed forward and backward ms of the line through ``(few, small)`` and ``(batch, big)``.

    Clamped to ``[0, small's time]``: measurement noise can tilt the line below zero (a layer with no
    fixed cost) or above the small call's whole time, and neither is a cost a call can have.
    """

    def intercept(at_batch: float, at_few: float) -> float:
        fixed = (batch * at_few - few * at_batch) / (batch - few)
        return min(max(fixed, 0.0), at_few)

    return intercept(big.forward_ms, small.forward_ms), intercept(big.backward_ms, small.backward_ms)


def measure_fixed(
    gm: fx.GraphModule,
    groups: Sequence[Group],
    inputs: Sequence[Tensor],
    batch: int,
    costs: Mapping[str, LayerCost],
    repeats: int,
    clock: str,
    precision: str,
) -> tuple[dict[str, tuple[float, float]], dict[str, tuple[SizedCost, ...]], dict[str, object]]:
    """Per group id, its fixed (forward, backward) ms and its times at every measured size (``costs``,
    measured at ``batch``, among them), and what to record in ``profile.extra``.

    Layers are measured again on the first ``s`` samples of every input, for each ``s`` of
    :func:`sizes_of`; the fixed times are the line through ``batch`` and the smallest. A model whose
    traced graph cannot run a smaller batch (a size fixed at tracing) gets neither: the record says
    why, and the planner prices its microbatches as proportional to their samples.
    """
    sizes = sizes_of(batch)
    if not sizes:
        return {}, {}, {"skipped": "a batch of 1 has no smaller batch to compare with"}
    measured: dict[int, Mapping[str, LayerCost]] = {}
    for few in sizes:
        small_inputs = [t[:few] if t.dim() and t.shape[0] == batch else t for t in inputs]
        try:
            profiler = LayerProfiler(gm, groups, repeats=repeats, clock=clock, precision=precision,
                                     split=True)  # fmt: skip
            measured[few] = profiler.profile(*small_inputs)
        except Exception as exc:  # the graph may bake the batch in; the main profile still stands
            first = str(exc).splitlines()[0] if str(exc) else ""
            log.warning("no fixed per-call times: the traced graph did not run %d samples: %s", few, first)
            why = f"the traced graph did not run {few} samples: {type(exc).__name__}: {first}"
            return {}, {}, {"skipped": why}
    few = sizes[-1]
    small = measured[few]
    fixed = {gid: fit_fixed(costs[gid], small[gid], batch, few) for gid in costs if gid in small}
    sized = {
        gid: (sized_entry(batch, cost), *(sized_entry(s, at[gid]) for s, at in measured.items() if gid in at))
        for gid, cost in costs.items()
    }
    return fixed, sized, {"small_batch": few, "sizes": [batch, *sizes]}


def estimate_sizes(
    estimator: Callable[[], LayerProfiler],
    inputs: Sequence[Tensor],
    batch: int,
    costs: Mapping[str, LayerCost],
) -> dict[str, tuple[SizedCost, ...]]:
    """A device model's times at every size of :func:`sizes_of` (``costs``: its estimate at ``batch``):
    a fresh ``estimator()`` per size on the first samples of every (meta) input. A device model
    prices each kernel as the longest of its compute, its memory traffic and a launch
    (:mod:`partitioner.profiler.estimate`), so a small microbatch's matrix products, bound by their
    weights' bytes, cost more per sample: the device's efficiency curve, priced like a measured one."""
    found: dict[int, Mapping[str, LayerCost]] = {}
    for few in sizes_of(batch):
        found[few] = estimator().profile(*[t[:few] if t.dim() and t.shape[0] == batch else t for t in inputs])
    return {
        gid: (sized_entry(batch, cost), *(sized_entry(s, at[gid]) for s, at in found.items() if gid in at))
        for gid, cost in costs.items()
    }
