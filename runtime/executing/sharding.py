"""Sharded data parallelism inside a stage: FSDP2's ``fully_shard`` at the plan's shard level.

The levels (docs/layout-3d.md) map onto FSDP2's switches, set before every backward by
:func:`before_backward` (the pipeline, not FSDP, knows which of a copy's microbatches is its last):

- ``optimizer`` (ZeRO-1): kept unsharded for the whole minibatch (``reshard_after_forward=False``, no
  resharding after a backward but the last), gradients accumulated unsharded and reduce-scattered
  once, in the copy's last backward;
- ``gradients`` (ZeRO-2): as ``optimizer``, but every backward reduce-scatters its gradient;
- ``full`` (ZeRO-3): resharded after every forward and backward, gathered again for each.

Under a split backward (zb1p, zbv) FSDP2's own timing is wrong: it reduce-scatters when a
backward's autograd pass ends, which for a B is before W has made the weight gradients. So there,
as torch.distributed.pipelining's stage does for FSDP, every B and W runs with FSDP2's gradient
sync, its resharding after backward and its last-backward finalisation off (:func:`before_backward`),
the stage stays gathered from its first forward of the minibatch (no resharding after forward, at
every level: W reads the weights the forward saved), and :func:`reduce_gradients`, called before the
step once the copy's last W is done, reduce-scatters the accumulated gradients and reshards, at every
shard level. So under a split backward ``gradients`` and ``full`` hold what ``optimizer`` holds from
a minibatch's first forward to its step (the whole stage's weights and gradient), and send one
reduce-scatter a minibatch.

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

__all__ = ["before_backward", "reduce_gradients", "shard_stage"]


def shard_stage(module: nn.Module, data_mesh: Any, level: str, split: bool = False) -> nn.Module:
    """``module`` sharded over the copies of ``data_mesh`` (1D) at ``level``, in place; ``split``:
    the schedule splits its backwards (kept gathered until :func:`reduce_gradients`)."""
    from torch.distributed.fsdp import fully_shard

    again = level == "full" and not split
    sharded: Any = fully_shard(module, mesh=data_mesh, reshard_after_forward=again)
    sharded.set_gradient_divide_factor(1.0)
    sharded.set_force_sum_reduction_for_comms(True)  # (gloo has no pre-multiplied sum)
    return sharded  # type: ignore[no-any-return]


def before_backward(module: nn.Module, level: str, last: bool, split: bool = False) -> None:
    """Set FSDP2's switches for the next backward: whether it reduce-scatters and reshards (under a
    split backward never: :func:`reduce_gradients` does both after the last W)."""
    if split:
        module.set_is_last_backward(False)  # type: ignore[operator]
        module.set_reshard_after_backward(False)  # type: ignore[operator]
        module.set_requires_gradient_sync(False)  # type: ignore[operator]
        return
    if level == "full":
        return
    module.set_requires_gradient_sync(last or level == "gradients")  # type: ignore[operator]
    module.set_reshard_after_backward(last)  # type: ignore[operator]


def reduce_gradients(module: nn.Module) -> None:
    """After a split backward's last W of the minibatch: reduce-scatter the gradients every B and W
    accumulated unsharded, and reshard. FSDP2 has no public call for a backward it did not see run,
    so this runs its post-backward by hand, as torch.distributed.pipelining's ``perform_reduce_grad``
    does: each parameter group's ``post_backward``, then the root's final callback (which waits for
    the reduce-scatters and resets FSDP2's state for the next minibatch)."""
    from torch.distributed.fsdp import fully_shard

    module.set_is_last_backward(True)  # type: ignore[operator]
    module.set_reshard_after_backward(True)  # type: ignore[operator]
    module.set_requires_gradient_sync(True)  # type: ignore[operator]
    state: Any = fully_shard.state(module)  # type: ignore[attr-defined]
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
