"""The peak of a device that hosts several stages (interleaved, zbv), from its rank's own list.

Each stage's closed-form peak (:func:`~partitioner.optimizer.pricing.memory.peak_bytes`) assumes
its gradients exist for the whole step and its items in flight all at once. On a device of several
stages neither holds for all of them together: the runtime frees gradients after every step
(``zero_grad(set_to_none=True)``), a stage's appear with its first backward, and the stages' items
peak at different points of the list. So the device's peak is the highest level over its rank's
actions in order (no timing needed: a rank's own order decides what it holds): every stage's
weights, optimizer state and master copy; the gradients of each stage that has run a backward this
step; each stage's items between their forward and the backward that frees them (a split
backward's W), and between a split backward's B and W what W needs; and the transient bytes of
the one backward running (its working bytes, and the gradient it adds to one its stage made
earlier in the step). Measured on
vgg16's interleaved plan (`pipeplan run --measure-memory`): the rank of stages 1 and 3 held its
later stage's gradients and transient while its earlier stage's gradients did not exist yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from runtime.schedule import Action

__all__ = ["StageBytes", "walked_peak"]


@dataclass(frozen=True)
class StageBytes:
    """A stage's bytes as its device's list adds and drops them.

    Attributes:
        kept: held all the time: weights, optimizer state, master copy, tied copies.
        grads: its gradients, from its first backward of a step until the step.
        item: one item's saved activations, from its forward until the backward that frees them.
        transient: held while one of its backwards runs (its working bytes).
        deferred: one item's bytes a split backward keeps from its B to its W.
        added: held while a backward (a split backward's W) adds to gradients its stage made
            earlier in the step: the gradient being added (the step's first backward makes them).
    """

    kept: float
    grads: float
    item: float
    transient: float
    deferred: float = 0.0
    added: float = 0.0


def walked_peak(actions: Iterable[Action], stages: Mapping[int, StageBytes], split: bool) -> float:
    """The highest bytes a device holds over ``actions`` (one step of its rank's list), hosting
    ``stages`` (stage -> its bytes); ``split``: a backward is a B and a W, and W frees the item."""
    level = sum(b.kept for b in stages.values())  # kept up to date action by action
    grads: set[int] = set()
    peak = level
    for a in actions:
        b = stages[a.stage]
        if a.kind == "F":
            level += b.item
            peak = max(peak, level)
        elif a.kind in ("B", "W"):
            frees = a.kind == "W" or not split
            adds = frees and a.stage in grads
            if frees and not adds:
                grads.add(a.stage)
                level += b.grads
            peak = max(peak, level + b.transient + (b.added if adds else 0.0))
            if split:  # B keeps what its W needs, W drops it
                level += b.deferred if a.kind == "B" else -b.deferred
            if frees:
                level -= b.item
        elif a.kind == "S" and a.stage in grads:
            grads.discard(a.stage)
            level -= b.grads
    return peak
