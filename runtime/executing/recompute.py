"""Activation recomputation of a stage's forward (activation checkpointing), as plan.json asks.

A recomputing stage runs its forward under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant):
autograd then keeps only the stage's inputs per microbatch in flight, and the backward runs the forward
again to rebuild the activations it needs. ``preserve_rng_state`` replays the forward's RNG state, so
dropout draws the same masks in the recomputation; the global RNG stream is left as if the stage had
not recomputed, so a run matches its non-recomputing twin draw for draw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["run_forward"]


def run_forward(call: Callable[..., Any], args: tuple[torch.Tensor, ...], recompute: bool) -> Any:
    """``call(*args)``, recomputed in backward when ``recompute`` and autograd records the call."""
    if not recompute or not torch.is_grad_enabled():
        return call(*args)
    return checkpoint(call, *args, use_reentrant=False, preserve_rng_state=True)
