"""Each layer's fixed time per call, fitted from a second measurement at a smaller batch.

A layer's time is not proportional to its batch: every call pays launches, Python dispatch and
allocator work whatever its size. A minibatch split into M microbatches pays that M times, which is
what makes more microbatches slower past some count and what ``--schedule auto``'s microbatch
search weighs against the bubble. Two measurements, at the minibatch ``b`` and at ``s = b / 8``,
give each layer's line ``t(n) = fixed + n * per_sample``; :func:`partitioner.graph.at_microbatches`
then charges ``fixed`` once per microbatch.

The smaller batch is an eighth of the larger one because its noise enters the fit amplified by
``b / (b - s)`` (8/7 here, against 2 for a half) and an eighth is where small microbatches live.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch.fx as fx
from torch import Tensor

from partitioner.profiler.measure import LayerCost, LayerProfiler
from partitioner.profiler.trace import Group

__all__ = ["fit_fixed", "measure_fixed", "small_batch"]

log = logging.getLogger(__name__)


def small_batch(batch: int) -> int | None:
    """The second batch size: an eighth of ``batch``, at least 1; None for a batch of 1."""
    return max(1, batch // 8) if batch >= 2 else None


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
) -> tuple[dict[str, tuple[float, float]], dict[str, object]]:
    """Per group id, its fixed (forward, backward) ms, and what to record in ``profile.extra``.

    Layers are measured again on the first ``small_batch(batch)`` samples of every input. A model
    whose traced graph cannot run that batch (a size fixed at tracing) gets no fixed times: the
    record says why, and the planner prices its microbatches as proportional to their samples.
    """
    few = small_batch(batch)
    if few is None:
        return {}, {"skipped": "a batch of 1 has no smaller batch to compare with"}
    small_inputs = [t[:few] if t.dim() and t.shape[0] == batch else t for t in inputs]
    try:
        profiler = LayerProfiler(gm, groups, repeats=repeats, clock=clock, precision=precision)
        small = profiler.profile(*small_inputs)
    except Exception as exc:  # the graph may bake the batch in; the main profile still stands
        first = str(exc).splitlines()[0] if str(exc) else ""
        log.warning("no fixed per-call times: the traced graph did not run %d samples: %s", few, first)
        return {}, {"skipped": f"the traced graph did not run {few} samples: {type(exc).__name__}: {first}"}
    fixed = {gid: fit_fixed(costs[gid], small[gid], batch, few) for gid in costs if gid in small}
    return fixed, {"small_batch": few}
