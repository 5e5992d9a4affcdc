"""Sharded data parallelism inside a stage: FSDP2's ``fully_shard`` at the plan's shard level.

The levels (docs/layout-3d.md) map onto FSDP2's switches, set before every backward by
:func:`before_backward` (the pipeline, not FSDP, knows which of a copy's microbatches is its last):

- ``optimizer`` (ZeRO-1): kept unsharded for the whole minibatch (``reshard_after_forward=False``, no
  resharding after a backward but the last), gradients accumulated unsharded and reduce-scattered
  once, in the copy's last backward;
- ``gradients`` (ZeRO-2): as ``optimizer``, but every backward reduce-scatters its gradient;
- ``full`` (ZeRO-3): resharded after every forward and backward, gathered again for each.

FSDP2 averages gradients over the copies by default; the runtime's loss is already scaled by each
microbatch's share of the minibatch, so the copies' gradients are summed (divide factor 1), as the
replicated path's all-reduce sums them.

The stage's generated forward reads its weights directly (no submodule's forward runs), so FSDP2's
hooks can only sit on the stage itself: the whole stage is one unit (one all-gather, one
reduce-scatter), not one per layer as the contract's memory table prices ``full``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["before_backward", "shard_stage"]


def shard_stage(module: nn.Module, data_mesh: Any, level: str) -> nn.Module:
    """``module`` sharded over the copies of ``data_mesh`` (1D) at ``level``, in place."""
    from torch.distributed.fsdp import fully_shard

    sharded: Any = fully_shard(module, mesh=data_mesh, reshard_after_forward=level == "full")
    sharded.set_gradient_divide_factor(1.0)
    sharded.set_force_sum_reduction_for_comms(True)  # (gloo has no pre-multiplied sum)
    return sharded  # type: ignore[no-any-return]


def before_backward(module: nn.Module, level: str, last: bool) -> None:
    """Set FSDP2's switches for the next backward: whether it reduce-scatters and reshards."""
    if level == "full":
        return
    module.set_requires_gradient_sync(last or level == "gradients")  # type: ignore[operator]
    module.set_reshard_after_backward(last)  # type: ignore[operator]
