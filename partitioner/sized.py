"""A layer's time per call at the microbatch sizes it was measured at, and at any size between.

A layer's time is not proportional to its samples: small matrix products run at a lower
efficiency than large ones, and every call pays launches and dispatch. A line through two sizes
(:mod:`partitioner.profiler.fixed`) misses the curve between them: on an MLP of 512-wide linears
(one CPU thread) the line through 64 and 8 samples priced a call of 16 at 0.71 of what it measured.
So the profile measures every layer at the sizes a search considers (the batch and its halvings,
``partitioner.profiler.fixed.sizes_of``) and a plan prices the microbatch it runs from the nearest
of them: exact at a measured size, linear between two, the line through the two nearest beyond.

Each entry also holds the split backward's two parts timed apart (zb1p, zbv: B, the input
gradients; W, the weight gradients; ``runtime.executing.split_backward``), so a split schedule is priced as it
runs rather than by a fixed share of the fused backward. Pure Python: the optimizer reads these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SizedCost", "at_size", "sized_from_json", "sized_to_json"]


@dataclass(frozen=True)
class SizedCost:
    """One layer's times per call at ``samples`` samples, in milliseconds.

    Attributes:
        samples: the call's samples (the microbatch's size).
        forward_ms: its forward.
        backward_ms: its fused backward (input and weight gradients in one autograd call).
        input_ms: a split backward's B (the input gradients, keeping what W needs); 0 with
            ``weight_ms`` 0: not measured.
        weight_ms: a split backward's W (the weight gradients from what B kept).
    """

    samples: float
    forward_ms: float
    backward_ms: float
    input_ms: float = 0.0
    weight_ms: float = 0.0

    @property
    def split(self) -> bool:
        """Whether B and W were timed."""
        return self.input_ms + self.weight_ms > 0.0


def at_size(entries: Sequence[SizedCost], samples: float) -> SizedCost:
    """The times of one call of ``samples`` samples: an entry's own where measured at that size,
    linear between the two sizes around it, and the line through the two nearest outside them
    (clamped at 0; one entry alone: scaled in proportion). ``entries`` must not be empty."""
    ordered = sorted(entries, key=lambda e: e.samples)
    for e in ordered:
        if math.isclose(e.samples, samples):
            return SizedCost(samples, e.forward_ms, e.backward_ms, e.input_ms, e.weight_ms)
    if len(ordered) == 1:
        e, k = ordered[0], samples / ordered[0].samples
        return SizedCost(samples, e.forward_ms * k, e.backward_ms * k, e.input_ms * k, e.weight_ms * k)
    i = next((j for j, e in enumerate(ordered) if e.samples > samples), len(ordered))
    i = min(max(i, 1), len(ordered) - 1)
    lo, hi = ordered[i - 1], ordered[i]
    u = (samples - lo.samples) / (hi.samples - lo.samples)

    def line(a: float, b: float) -> float:
        return max(0.0, a + u * (b - a))

    split = lo.split and hi.split
    return SizedCost(
        samples,
        line(lo.forward_ms, hi.forward_ms),
        line(lo.backward_ms, hi.backward_ms),
        line(lo.input_ms, hi.input_ms) if split else 0.0,
        line(lo.weight_ms, hi.weight_ms) if split else 0.0,
    )


def sized_to_json(entries: Sequence[SizedCost]) -> list[list[float]]:
    """profile.json's ``sized``: ``[samples, forward_ms, backward_ms, input_ms, weight_ms]`` each."""
    return [[e.samples, e.forward_ms, e.backward_ms, e.input_ms, e.weight_ms] for e in entries]


def sized_from_json(doc: Sequence[Sequence[float]]) -> tuple[SizedCost, ...]:
    """The entries of profile.json's ``sized``; ValueError for a malformed one (a size of no samples,
    a time that is negative or not finite, the wrong number of fields)."""
    entries = []
    for row in doc:
        if not 3 <= len(row) <= 5:
            fields = "[samples, forward_ms, backward_ms, input_ms, weight_ms]"
            raise ValueError(f"sized entry {list(row)!r}: expected {fields}")
        values = [float(v) for v in row]
        if not values[0] > 0 or not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"sized entry {list(row)!r}: samples must be > 0 and times finite and >= 0")
        entries.append(SizedCost(*values))
    return tuple(entries)
