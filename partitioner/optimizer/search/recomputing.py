"""What a stage costs when it recomputes its forward in backward, per downset state, so that the
exact synchronous search can price every stage both ways and keep the cheaper that fits
(docs/optimizer-search.md).

Why: the planner's other way to plan recomputation searches a profile whose layers save nothing
and re-prices the plan found; that search does not see what a recomputing stage still holds (its
inputs per item in flight, one item's activations while its backward runs again), so its plan can
fail the price, and it never mixes stages that keep with stages that recompute. Here a stage is
priced as ``price.held_memory`` prices it with recomputation: per item its forward's inputs, the
loss's saved bytes and the outputs it sends, and once one item's saved bytes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partitioner.graph import Profile
from partitioner.optimizer.pricing.stage import FloatArray, IntArray
from partitioner.optimizer.search.states import StateSet

__all__ = ["Recomputing", "recomputing_of"]


@dataclass(frozen=True)
class Recomputing:
    """The states' sums a recomputing stage (k, j] is priced from.

    Attributes:
        forward_s: forward seconds of each state: what recomputing adds to a stage's compute.
        kept_bytes: the loss's saved bytes in each state (``StageLoad.kept_bytes``: the runtime
            runs the loss outside the recomputed forward, so it keeps them per item).
        input_bytes: per state k, what a stage starting there takes in per item
            (``StageLoad.input_bytes``): every tensor crossing the cut, and the model's inputs
            that it or a later stage reads.
        every: every stage recomputes (``recompute="all"``); else only where it does not fit
            otherwise (``auto``).
    """

    forward_s: FloatArray
    kept_bytes: FloatArray
    input_bytes: FloatArray
    every: bool

    def per_item(self, states: StateSet, k: IntArray, j: IntArray) -> FloatArray:
        """What stages (k, j] hold per item in flight when they recompute."""
        sent = states.sent_bytes[j]
        return np.asarray(
            self.input_bytes[k] + self.kept_bytes[j] - self.kept_bytes[k] + sent, dtype=np.float64
        )

    def once(self, states: StateSet, k: IntArray, j: IntArray) -> FloatArray:
        """What they hold once, while one item's backward runs its forward again: its saved bytes
        but the loss's, which are among the per-item bytes."""
        saved = states.saved_bytes[j] - states.saved_bytes[k]
        return np.asarray(saved - (self.kept_bytes[j] - self.kept_bytes[k]), dtype=np.float64)


def recomputing_of(profile: Profile, states: StateSet, every: bool) -> Recomputing:
    """:class:`Recomputing` of ``states`` (built on ``profile``, free sinks removed)."""
    nodes = {n.id: n for n in profile.nodes}
    forward = np.array([nodes[i].forward_ms / 1000.0 for i in states.layer_ids])
    loss = np.array(
        [float(nodes[i].saved_bytes) if nodes[i].op == "output" else 0.0 for i in states.layer_ids]
    )
    relay = np.zeros(len(states))
    index = {lid: i for i, lid in enumerate(states.layer_ids)}
    for node in profile.nodes:
        if node.op != "input":
            continue
        readers = sum(1 << index[n.id] for n in profile.nodes if node.id in n.inputs and n.id in index)
        relay += np.array([float(node.output_bytes) if readers & ~m else 0.0 for m in states.masks])
    return Recomputing(states.sums(forward), states.sums(loss), states.act_bytes + relay, every)
