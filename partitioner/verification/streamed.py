"""Run the original model holding only some of its weights: the others are made when an operation
reads them and dropped after it, and made again if backward needs them.

``pipeplan verify`` compares each stage with the same layers of the original, unsplit model, and
must not hold that model to do it. The original is built without its tensors (``_stagekit.Original``:
meta or deferred); :class:`Streamed` then runs its own ``forward`` with a torch function mode that
hands every operation the real values of the weights it reads (``Original.values``: the same seeded,
exact or checkpoint values the stages start from), and saved-tensor hooks that keep only the name of a
weight autograd saves for backward. The weights put in with :meth:`Streamed.resident` (one stage's,
as autograd leaves) stay; the memory of a pass is those, the activations autograd keeps, and the
weights of one operation at a time.

The model's code sees its parameters as they are in the unmaterialised model (their ``device`` may
read ``meta``); tensors it makes on the meta device from that are made on the run's device instead.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from runtime.building.deferred_init import as_meta, is_deferred

__all__ = ["Streamed"]

_META = torch.device("meta")


@dataclass(frozen=True)
class _Part:
    """A view of a weight: its canonical name and where the view lies in the weight's storage."""

    name: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Materialise(TorchFunctionMode):
    """Gives every torch function real values for the weights it reads (see the module docstring)."""

    def __init__(self, streamed: Streamed, pending: dict[int, _Part], device: torch.device) -> None:
        super().__init__()
        self.streamed, self.pending, self.device = streamed, pending, device
        self.views: list[Tensor] = []  # views handed out by attribute reads, kept so their ids stay theirs

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__":  # an attribute read (.shape, .data, .T): no values
            part = self.pending.get(id(args[0])) if args else None
            if part is not None and is_deferred(args[0]):  # a view of a deferred weight: taken on meta
                args = (as_meta(args[0]), *args[1:])
            result = func(*args, **kwargs)
            if part is not None and isinstance(result, Tensor) and result.device.type == "meta":
                self.views.append(result)
                self.pending[id(result)] = _Part(
                    part.name, tuple(result.shape), tuple(result.stride()), int(result.storage_offset())
                )
            return result
        wanted = [self.pending[id(v)] for v in _leaves((args, kwargs)) if id(v) in self.pending]
        made = self.streamed.weights(wanted) if wanted else {}
        args, kwargs = tree_map(lambda v: self._real(v, made), (args, kwargs))
        result = func(*args, **kwargs)
        if isinstance(result, Tensor):  # a view of a weight (w.t()) is known as one while it lives
            self.streamed.adopt(result)
        return result

    def _real(self, value: Any, made: Mapping[_Part, Tensor]) -> Any:
        if isinstance(value, torch.device) and value.type == "meta":
            return self.device
        if isinstance(value, Tensor) and id(value) in self.pending:
            return made[self.pending[id(value)]]
        return value


def _leaves(tree: Any) -> list[Any]:
    return tree_flatten(tree)[0]


class Streamed:
    """The original model of a package, run with its weights materialised on use.

    Args:
        original: the package's ``_stagekit.Original`` (the model without its tensors).
        device: where the weights are made and the model runs.
    """

    def __init__(self, original: Any, device: str | torch.device = "cpu") -> None:
        self.original = original
        self.device = torch.device(device)
        self._live: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        self._names: dict[int, str] = {}

    @property
    def model(self) -> torch.nn.Module:
        """The original model: call it inside :meth:`running`."""
        return self.original.root  # type: ignore[no-any-return]

    def weights(self, parts: list[_Part]) -> dict[_Part, Tensor]:
        """The real values of views of weights, made together (a module's weight and bias are made by
        one init), their storages recorded as weights' (see ``_pack``)."""
        values = self.original.values([part.name for part in parts])
        made = {}
        for part in parts:
            value = values[part.name].to(self.device)
            storage = value.untyped_storage()
            view = torch.empty(0, dtype=value.dtype, device=value.device).set_(
                storage, part.offset, part.size, part.stride
            )
            self._live[storage.data_ptr()] = view  # alive while the operation reading it runs
            self._names[storage.data_ptr()] = part.name
            made[part] = view
        return made

    def adopt(self, t: Tensor) -> None:
        """Know ``t`` as a weight's view if it shares the storage of a weight being read."""
        if t.device.type == "meta" or t.layout != torch.strided:
            return
        pointer = t.untyped_storage().data_ptr()
        if self._live.get(pointer) is not None:
            self._live[pointer] = t

    def _pack(self, t: Tensor) -> Any:
        """What autograd keeps of a saved tensor: a weight's name and view, or the tensor itself."""
        if t.device.type == "meta" or t.layout != torch.strided:
            return t
        pointer = t.untyped_storage().data_ptr()
        if self._live.get(pointer) is None:
            return t
        return _Part(self._names[pointer], tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def _unpack(self, saved: Any) -> Any:
        return self.weights([saved])[saved] if isinstance(saved, _Part) else saved

    @contextlib.contextmanager
    def resident(self, tensors: Mapping[str, Tensor]) -> Iterator[None]:
        """Hold ``tensors`` in the model under their names, and every other name of a tied one, for
        the block (a stage's parameters, as leaves whose gradients the caller reads)."""
        original = self.original
        by_canonical = {original.canonical[name]: t for name, t in tensors.items()}
        names = [n for n in original.slots if original.canonical[n] in by_canonical]
        before = {name: original.tensor(name) for name in names}
        try:
            for name in names:
                module, attr = original.slots[name]
                store = module._parameters if attr in module._parameters else module._buffers
                store[attr] = by_canonical[original.canonical[name]]
            yield
        finally:
            for name, tensor in before.items():
                module, attr = original.slots[name]
                store = module._parameters if attr in module._parameters else module._buffers
                store[attr] = tensor

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Inside: calling :attr:`model` materialises each weight when read; buffers the forward
        changes in place (batch-norm statistics) are put back afterwards."""
        original = self.original
        pending: dict[int, _Part] = {}
        kept: dict[str, Tensor] = {}
        for name in original.slots:
            t = original.tensor(name)
            if t.device.type == "meta" or is_deferred(t):
                part = _Part(
                    original.canonical[name], tuple(t.shape), tuple(t.stride()), int(t.storage_offset())
                )
                pending[id(t)] = part
            elif name not in original.parameters:
                kept[name] = t.detach().clone()
        try:
            with (
                _Materialise(self, pending, self.device),
                torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack),
            ):
                yield
        finally:
            with torch.no_grad():
                for name, value in kept.items():
                    original.tensor(name).copy_(value)
