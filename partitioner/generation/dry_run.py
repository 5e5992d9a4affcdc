"""Run a traced graph without computing anything: every value's kind and shape, never a number.

Code generation needs to know which nodes make tensors and what the model returns, not its values;
running the real model for that cost seconds on a CPU (vgg16: two full forwards, 13 of the 18 s of
``pipeplan partition``). :func:`dry_run` runs the graph on a batch of zero samples with every
parameter and buffer swapped for a stand-in of its shape and dtype that holds one element (an
expanded scalar; the originals are put back afterwards): each operator does its shape checks and
returns an empty result, in microseconds, and the model's weights need not exist (a model built on
the meta device runs the same way). Modules run in eval mode meanwhile (batch norm refuses an empty
batch in training mode).

A graph that needs its batch size in a shape (``x.view(x.size(0), -1)``) or reads values cannot run
on an empty batch; it then runs on meta tensors (no data either, but torch's meta kernels import
torch._dynamo, seconds the first time), then on fake tensors of the device it was traced on (a
graph that moves a meta tensor to the CPU). Fake tensors carry a shape environment, so a value the
graph reads (``.item()``, ``.tolist()`` of a mixture-of-experts router, a ``nonzero``) is a symbol
there, as it was when torch.export traced it, and the sizes it sets are symbols too.
:class:`NeedsValues` says when none works.

Example:
    >>> output, values = dry_run(traced.graph_module, bundle.inputs)  # doctest: +SKIP
    >>> output.shape  # doctest: +SKIP
    torch.Size([0, 1000])
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn

__all__ = ["NeedsValues", "dry_run", "meta_as_zeros"]

log = logging.getLogger(__name__)

_META = torch.device("meta")


class NeedsValues(RuntimeError):
    """The graph cannot run without real values (the message names the node)."""


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``t``'s shape and dtype holding one element (every index reads it)."""
    return torch.empty((), dtype=t.dtype).expand(t.shape)


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(_META)


@contextlib.contextmanager
def _swapped(
    gm: fx.GraphModule, make: Callable[[torch.Tensor], torch.Tensor], eval_mode: bool
) -> Iterator[None]:
    """Every parameter and buffer of ``gm`` (and tensor attribute the graph reads) replaced by
    ``make(tensor)`` (one per original, so tied tensors stay one); the originals and the modules'
    modes are put back afterwards."""
    swapped: list[tuple[dict[str, Any] | nn.Module, str, Any]] = []
    made: dict[int, torch.Tensor] = {}
    modes = [(m, m.training) for m in gm.modules()]

    def replace(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = make(t)
            made[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)]

    try:
        for module in gm.modules():
            stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for store in stores:
                for name, t in store.items():
                    if t is not None and t.layout == torch.strided:
                        swapped.append((store, name, t))
                        store[name] = replace(t)
        for node in gm.graph.nodes:
            owner_path, _, attr = str(node.target).rpartition(".")
            owner = gm.get_submodule(owner_path) if node.op == "get_attr" else None
            value = getattr(owner, attr, None) if owner is not None else None
            registered = owner is not None and (attr in owner._buffers or attr in owner._parameters)
            if owner is not None and isinstance(value, torch.Tensor) and not registered:
                swapped.append((owner, attr, value))
                object.__setattr__(owner, attr, replace(value))
        if eval_mode:
            gm.eval()
        yield
    finally:
        for holder, name, original in reversed(swapped):
            if isinstance(holder, dict):
                holder[name] = original
            else:
                object.__setattr__(holder, name, original)
        for module, training in modes:
            module.training = training


def _zeros_for_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t


@contextlib.contextmanager
def meta_as_zeros(gm: fx.GraphModule) -> Iterator[None]:
    """Within the block every meta tensor of ``gm`` is a CPU tensor of zeros (put back afterwards).

    For running a graph for real when no dry run works: a graph re-traced without its weights holds
    them on meta, and a meta tensor has nothing to copy (``Cannot copy out of meta tensor``). Zeros
    give every tensor its shape and kind, which is all a caller of a dry run reads.
    """
    with _swapped(gm, _zeros_for_meta, eval_mode=False):
        yield


def _run(gm: fx.GraphModule, inputs: Sequence[Any]) -> tuple[Any, dict[str, Any]]:
    values: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            if n.op != "output":
                values[n.name] = result
            return result

    with torch.no_grad():
        return Recorder(gm).run(*inputs), values


def dry_run(gm: fx.GraphModule, inputs: Sequence[Any]) -> tuple[Any, dict[str, Any]]:
    """(the graph's output, every node's value by name) on an empty batch, or on meta tensors.
    Input tensors are batch-first.

    Raises:
        NeedsValues: the graph needs real values (names the error).
    """
    empty = [t[:0] if isinstance(t, torch.Tensor) and t.dim() else t for t in inputs]
    try:
        with _swapped(gm, _stand_in, eval_mode=True):
            return _run(gm, empty)
    except Exception as exc:
        log.info("the graph cannot run on an empty batch (%s); running it on meta tensors", exc)
    meta = [_on_meta(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    try:
        with _swapped(gm, _on_meta, eval_mode=False):
            return _run(gm, meta)
    except Exception as exc:
        log.info("the graph cannot run on meta tensors (%s); running it on fake tensors", exc)
    try:
        return _fake_run(gm, inputs)
    except Exception as exc:
        raise NeedsValues(f"the traced graph cannot run without values: {exc}") from exc


def _fake_run(gm: fx.GraphModule, inputs: Sequence[Any]) -> tuple[Any, dict[str, Any]]:
    """The graph on fake tensors (torch's ``FakeTensorMode``: shape, dtype and device, no storage).

    For a graph whose weights are on meta but that moves tensors to the device it was traced on
    (torch.export writes ``.to(cpu)`` into a Hugging Face model's graph, which a meta tensor cannot
    do): a meta tensor is faked on the CPU, any other on its own device. The shape environment turns
    what the graph reads from a tensor into an unbacked symbol instead of refusing.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())

    def fake(t: torch.Tensor) -> torch.Tensor:
        device = torch.device("cpu") if t.device.type == "meta" else t.device
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    faked = [fake(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    with _swapped(gm, fake, eval_mode=False), mode:
        return _run(gm, faked)
