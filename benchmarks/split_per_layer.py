"""A split backward timed per layer, as the profiler times it, against the same stage timed whole, as
the runtime runs it: how far a stage's price (its layers' B + W summed) is from its own B + W.

A stage of ``--blocks`` x (``Linear(W, W)`` + ReLU) at ``--samples`` samples on one thread, its input
needing a gradient (a stage after the first). Four ways, interleaved round by round so that the
machine's load hits them alike, CPU time (``time.process_time``), medians of ``--rounds``:

- the stage's fused backward (``torch.autograd.grad`` of its output to its input and weights);
- the stage's split backward (``runtime.executing.split_backward``: ``backward_input`` then
  ``backward_weight``), what zb1p and zbv run;
- each layer's fused backward, summed (how ``pipeplan profile`` prices a fused stage);
- each layer's split backward, summed (how it prices a split stage: ``Node.sized``'s B and W).

Run:  .venv/bin/python benchmarks/split_per_layer.py [--blocks 3 --width 512 --samples 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from runtime.executing.split_backward import backward_input, backward_weight

Timing = Callable[[Tensor], tuple[float, ...]]


def _ways(stage: nn.Sequential) -> dict[str, Timing]:
    params, clock = list(stage.parameters()), time.process_time

    def stage_fused(x: Tensor) -> tuple[float, ...]:
        y = stage(x)
        seed = torch.ones_like(y)
        t0 = clock()
        torch.autograd.grad([y], [x, *params], [seed])
        return (clock() - t0,)

    def stage_split(x: Tensor) -> tuple[float, ...]:
        y = stage(x)
        seed = torch.ones_like(y)
        t0 = clock()
        _, work = backward_input([y], [seed], [x], params)
        t1 = clock()
        backward_weight(work)
        return t1 - t0, clock() - t1

    def layers(split: bool) -> Timing:
        def timed(x: Tensor) -> tuple[float, ...]:
            b = w = 0.0
            h = x
            for layer in stage:
                h = h.detach().requires_grad_()
                y, own = layer(h), list(layer.parameters())
                seed = torch.ones_like(y)
                t0 = clock()
                if split:
                    _, work = backward_input([y], [seed], [h], own)
                    t1 = clock()
                    backward_weight(work)
                    b, w = b + t1 - t0, w + clock() - t1
                else:
                    torch.autograd.grad([y], [h, *own], [seed])
                    b += clock() - t0
                h = y
            return (b, w) if split else (b,)

        return timed

    return {
        "stage fused": stage_fused,
        "stage split (B, W)": stage_split,
        "layers fused, summed": layers(False),
        "layers split (B, W), summed": layers(True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(args.blocks):
        blocks += [nn.Linear(args.width, args.width), nn.ReLU()]
    ways = _ways(nn.Sequential(*blocks))
    x = torch.randn(args.samples, args.width, requires_grad=True)
    times: dict[str, list[tuple[float, ...]]] = {name: [] for name in ways}
    for round_ in range(30 + args.rounds):
        for name, way in ways.items():
            taken = way(x)
            if round_ >= 30:
                times[name].append(taken)
    for name, rows in times.items():
        parts = [statistics.median(col) * 1e3 for col in zip(*rows, strict=True)]
        shown = " + ".join(f"{p:.3f}" for p in parts)
        print(f"{name}: {shown} = {sum(parts):.3f} ms")


if __name__ == "__main__":
    main()
