"""The fixed time of one split-backward B call, which a stage pays once and its layers' timings each.

zb1p and zbv run a stage's backward as B (``runtime.executing.split_backward.backward_input``: the
input gradients, walking the stage's autograd graph in Python to record what W needs) and W. The
profiler times each layer's B with a call of its own, so a stage priced as its layers' sum paid that
call's fixed part once a layer, where the runtime pays it once a stage: a stage of small layers was
over-priced by about a third (3 x ``Linear(512)`` + ReLU at 16 samples, ``benchmarks/split_per_layer.py``).
This measures the fixed part as B of a layer that computes almost nothing (a ReLU of one element,
no weights): what every layer's B pays besides its own work. Pricing takes it off each layer's B
(:func:`partitioner.graph.at_microbatches`), so a stage of k layers pays one call where it paid k
(a stage's own one call is then left out: docs/limits.md).
"""

from __future__ import annotations

import statistics
import time

import torch

from runtime.executing.split_backward import backward_input

__all__ = ["split_call_ms"]


def split_call_ms(device: torch.device, clock: str = "wall", repeats: int = 200) -> float:
    """Median milliseconds of ``backward_input`` on a one-element ReLU whose input needs a gradient,
    on ``device`` (``clock``: ``cpu`` for CPU time, else wall; CUDA synchronised around each call),
    after a fifth of ``repeats`` untimed."""
    read = time.process_time if clock == "cpu" else time.perf_counter
    cuda = device.type == "cuda"
    times = []
    for run in range(repeats):
        x = torch.ones(1, device=device, requires_grad=True)
        y = torch.relu(x)
        seeds: list[torch.Tensor | None] = [torch.ones_like(y)]
        if cuda:
            torch.cuda.synchronize()
        started = read()
        with torch.enable_grad():
            backward_input([y], seeds, [x], [])
        if cuda:
            torch.cuda.synchronize()
        if run >= repeats // 5:
            times.append((read() - started) * 1e3)
    return statistics.median(times)
