"""Trace a model built without its weights exactly as its real self would trace on a device.

A model built by :func:`runtime.building.meta_params.weightless` has its weights on the meta device. Tracing
it there works, but the graph is not the one a real model gives: torch.export writes the device it
traced on into the graph (``arange(..., device=meta)``), and some kernels lay out their outputs
differently on meta (an attention output that is contiguous on a CPU is not on meta, so the graph
gains ``contiguous`` nodes). The graph must be the real one: ``partition`` re-traces the model to
write its stages and finds each profiled layer by its node names.

So the model is traced on fake tensors of the real device (torch's ``FakeTensorMode``: a shape, a
dtype and a device, no storage; what torch.export itself traces with), and its tensors go back to
the meta device afterwards. Nothing of the model's size is allocated.

Example:
    >>> traced = trace_weightless(load_model("hf:llama", 2, lazy=True), torch.device("cpu"))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from partitioner.models.specs import ModelBundle
from partitioner.profiler.trace import Traced, trace_model

__all__ = ["trace_weightless"]


def trace_weightless(
    bundle: ModelBundle,
    device: torch.device,
    leaf_modules: Sequence[str] = (),
    input_shape: tuple[int, ...] | None = None,
    dynamic: bool = False,
) -> Traced:
    """:func:`~partitioner.profiler.trace.trace_model` of a bundle built with ``lazy=True``, as if its
    tensors were real on ``device``. Static shapes by default (a deep model exports two to three times
    faster); ``dynamic`` tries a dynamic batch first, as ``trace_model`` does, with a shape environment
    in the fake mode for the symbolic sizes. The traced graph module's tensors (and the bundle's
    module's) are on meta afterwards."""
    # (imported here: they bring sympy, half a CPU second that an fx package's partition never uses)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(allow_non_fake_inputs=False, shape_env=ShapeEnv() if dynamic else None)
    with mode:
        _swap(bundle.module, lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    maker = bundle.input_maker

    def fake_inputs(batch: int) -> tuple[Tensor, ...]:  # a dynamic export may ask for a batch of 2
        return tuple(mode.from_tensor(t.to(device)) for t in maker(batch))

    inputs = tuple(mode.from_tensor(t.to(device)) for t in bundle.inputs)
    faked = replace(bundle, inputs=inputs, input_maker=fake_inputs)
    try:
        traced = trace_model(faked, leaf_modules, input_shape, dynamic=dynamic)
    finally:
        _swap(bundle.module, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
    _swap(traced.graph_module, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
    return traced


def _swap(module: nn.Module, make: Callable[[Tensor], Tensor]) -> None:
    """Replace every parameter and buffer of ``module`` by ``make(it)``; a tensor held under several
    names (tied weights) stays one tensor."""
    made: dict[int, Tensor] = {}
    tensors = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in tensors:
        if id(tensor) not in made:
            new = make(tensor)
            made[id(tensor)] = (
                nn.Parameter(new, requires_grad=tensor.requires_grad)
                if isinstance(tensor, nn.Parameter)
                else new
            )
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        if leaf in owner._parameters:
            owner._parameters[leaf] = made[id(tensor)]  # type: ignore[assignment]
        else:
            owner._buffers[leaf] = made[id(tensor)]
