"""Time the optimizer's weight update, per parameter byte, for every optimizer the planner knows.

A training step is forward, backward *and* the update: SGD reads and writes each weight and its
gradient, Adam also two moments. On a CPU Adam's update of vgg16 costs about as much as its forward
and backward, and a run measures it inside each stage's compute, so a plan that leaves it out
predicts too little. The update is elementwise over the weights, so its cost is proportional to
their bytes: one rate per optimizer, stored in the profile, lets ``partition --optimizer X`` charge
each layer its own share (see :func:`partitioner.profiler.update_cost.with_update_time`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from partitioner.profiler.measure import Stopwatch

__all__ = ["UPDATE_BUDGET_BYTES", "measure_update"]

UPDATE_BUDGET_BYTES = 64 * 2**20
"""Parameter bytes timed at most: a prefix of the model's tensors this large gives the rate (the
update is linear in bytes) without Adam's state for all of a large model."""

_OPTIMIZERS: dict[str, Callable[[list[Tensor]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
}


def _sample(params: Sequence[Tensor], device: torch.device | None) -> list[Tensor]:
    """Tensors shaped as the first parameters up to the byte budget, with gradients, on ``device``
    (else the parameters' own; the update's cost does not depend on the values). A parameter that
    would cross the budget is cut to it (a flat prefix): the update is elementwise, so its rate per
    byte is the same, and the optimizer state of a 1 GiB embedding is not allocated to learn it."""
    chosen, total = [], 0
    for p in params:
        if total >= UPDATE_BUDGET_BYTES:
            break
        room = max(1, (UPDATE_BUDGET_BYTES - total) // p.element_size())
        shape = p.shape if p.numel() <= room else (room,)
        copy = torch.empty(shape, dtype=p.dtype, device=device or p.device).normal_(0, 0.02)
        copy.requires_grad_()
        copy.grad = torch.full_like(copy, 1e-3)
        chosen.append(copy)
        total += copy.numel() * copy.element_size()
    return chosen


def measure_update(
    module: nn.Module, repeats: int = 3, clock: str = "wall", device: torch.device | None = None
) -> dict[str, float]:
    """Seconds per parameter byte of one optimizer step, per optimizer (sgd, momentum, adam, adamw).

    Tensors shaped as the module's floating-point parameters are stepped (the module is left as it
    was), after one untimed step that allocates the optimizer's state; the median of ``repeats``.
    ``device``: where, for a module whose parameters are on the meta device. Empty when the module
    has no trainable floating-point parameters.
    """
    params = [p for p in module.parameters() if p.requires_grad and p.is_floating_point()]
    sample = _sample(params, device)
    nbytes = sum(p.numel() * p.element_size() for p in sample)
    if not nbytes:
        return {}
    stopwatch = Stopwatch(sample[0].device, clock)
    rates: dict[str, float] = {}
    for name, make in _OPTIMIZERS.items():
        optimizer, times = make(sample), list[float]()
        for run in range(1 + max(1, repeats)):
            with stopwatch.time(times if run else []):
                optimizer.step()
        rates[name] = statistics.median(times) / 1e3 / nbytes
        del optimizer
    return rates
