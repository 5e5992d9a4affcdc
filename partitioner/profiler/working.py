"""What a layer's backward holds beyond what its forward saved: its working bytes, and what a
split backward keeps from its B to its W.

A stage's backward runs its layers one after another. While layer k runs, the gradient of its
output (made by the layer after it, or received from the next stage) is alive, and it makes the
gradient of its input and whatever temporaries its backward needs; the next layer down then drops
the first. On early CNN layers these gradients are as large as the activations (two 8 MiB tensors
at a time on vgg16's first convolutions at batch 8), and a stage holds them beside every item it
keeps in flight. The memory model charges a stage the largest of its layers' working bytes once
(``StageLoad.working_bytes``): one item's backward runs at a time.

Counted as ``pipeplan run --measure-memory`` counts a rank's memory: live storages on a CPU (and on
the meta device, an estimate's shapes), the caching allocator's peak on CUDA (written as torch
documents it, untested on CUDA). Weight gradients are not working bytes: the memory model prices a
stage's gradients itself.

A split backward (zb1p, zbv) runs B, the input gradients, and later W, the weight gradients; W
needs the gradient that flowed into each weight's node (a linear's: the gradient of its output),
so B keeps it until W (``runtime/executing/split_backward.py``). On a decoder layer that is more than half
of what its forward saves (hf:llama: 2.5 against 4.3 MiB a minibatch), held for every item between
its B and its W (:func:`split_deferred`, ``Node.deferred_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from runtime.executing.split_backward import backward_input
from runtime.observing.peak_memory import _LiveStorages  # the counter behind ``run --measure-memory``

__all__ = ["backward_rise", "backward_working", "split_deferred"]


def backward_working(roots: Sequence[Tensor], leaves: Sequence[Tensor], seeds: Sequence[Tensor]) -> int:
    """Bytes a layer's backward holds at once: the gradients of its outputs it is given (``seeds``,
    one per differentiable output in ``roots``) and, at their highest, what it makes on the way to the
    gradients of its inputs (``leaves``: the inputs a real step differentiates; none on the model's
    first layer, whose backward then only reads its seeds). The graph is kept: the caller's own
    backward of the same forward still runs."""
    seeded = _distinct_bytes(seeds)
    if not roots or not leaves:
        return seeded
    return seeded + backward_rise(
        lambda: torch.autograd.grad(roots, leaves, seeds, retain_graph=True, allow_unused=True),
        roots[0].device,
    )


def split_deferred(
    roots: Sequence[Tensor], leaves: Sequence[Tensor], params: Sequence[Tensor], seeds: Sequence[Tensor]
) -> int:
    """Bytes a split backward keeps from the layer's B to its W: the gradients B records flowing
    into the nodes whose branches lead only to ``params``
    (``runtime.executing.split_backward.backward_input``, the runtime's own B), counted once per storage, and
    the ``seeds`` where W takes weights from the roots (all of them on a layer whose inputs take no gradient).
    The graph is kept."""
    if not roots or not params:
        return 0
    _, work = backward_input(list(roots), list(seeds), list(leaves), list(params))
    kept = [g for _, grads, _ in work.boundary for g in grads if g is not None]
    if work.rest:
        kept += seeds
    return _distinct_bytes(kept)


def backward_rise(
    run: Callable[[], object], device: torch.device, kept: dict[int, Tensor] | None = None
) -> int:
    """How far calling ``run`` (a backward) raises the bytes held, at the highest: what it makes,
    less the ``kept`` tensors it frees on the way (emptied here, so that autograd's references alone
    keep them alive until their node has run)."""
    if device.type == "cuda":
        if kept:
            kept.clear()
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        return max(0, int(torch.cuda.max_memory_allocated(device)) - base)
    counter = _Made(devices=("cpu", "meta"))  # meta: the estimate's shapes
    if kept:
        counter.add(kept.values())
        kept.clear()
    start = counter.level
    with counter:
        run()
    return max(0, int(counter.peak) - start)


class _Made(_LiveStorages):  # type: ignore[no-untyped-call]  # torch's mode is untyped
    """:class:`~runtime.observing.peak_memory._LiveStorages` counting only what the ops it sees allocate: an
    output that shares an input's storage (a view, a ``detach``, an in-place result) is no new memory. A
    backward takes views of tensors that were there before it (``t()`` of a linear's weight, a
    ``detach`` of a saved activation); counted as new, a 392 MiB weight would pass for working bytes."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        self.add(t for t in tree_leaves(out) if isinstance(t, Tensor) and _key(t) not in given)
        return out


def _key(t: Tensor) -> int:
    """The identity of ``t``'s storage (as the counter keys it)."""
    return int(t.untyped_storage()._cdata)


def _distinct_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes of the storages under ``tensors``, each counted once."""
    return sum({_key(t): t.untyped_storage().nbytes() for t in tensors}.values())
