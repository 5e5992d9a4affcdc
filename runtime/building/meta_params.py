"""Build a model without allocating its weights: parameters on the meta device, buffers real.

A 70B model is 140 GB of bfloat16 weights; building it to learn its shapes, trace it or plan it
would need a machine it does not fit on. Under :func:`weightless` every parameter a module
registers goes to the meta device (shape, dtype and no storage), so building costs what the
buffers cost. Buffers keep their values: they are small and often computed, not learned (rotary
frequencies, position ids, causal masks), and a layer cannot run without them. torch's own
``with torch.device("meta")`` would make them meta too and lose those values.

Two of torch's hooks do it: a parameter registration hook moves each new parameter to meta before
the module initialises it (initialising a meta tensor costs nothing), and a function mode builds
every large tensor a constructor makes on meta in the first place, so no transient allocation of
a large weight happens either (a buffer larger than :data:`LARGE` elements would lose its value:
:func:`split_buffers` reports none on real models of this kind).

Example:
    >>> with weightless():
    ...     layer = torch.nn.Linear(8192, 8192)
    >>> layer.weight.device.type
    'meta'
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["LARGE", "split_buffers", "weightless"]

LARGE = 1 << 24
"""Elements from which a constructor's tensor is built on meta (64 MiB of float32)."""

_CONSTRUCTORS = frozenset(
    (torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.empty_strided)
)


class _LargeOnMeta(TorchFunctionMode):
    """Tensor constructors without an explicit device build large tensors on the meta device."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in _CONSTRUCTORS and kwargs.get("device") is None:
            shape = func(*args, **{**kwargs, "device": "meta"})
            if math.prod(shape.shape) >= LARGE:
                return shape
        return func(*args, **kwargs)


def _to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    if param is None or param.device.type == "meta":
        return None  # keep the object: tied weights are the same Parameter under two names
    return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


@contextlib.contextmanager
def weightless() -> Iterator[None]:
    """Modules built inside get every parameter on the meta device; buffers keep their values."""
    # (the hook may return a replacement parameter, as its documentation says; its annotation says None)
    handle = nn.modules.module.register_module_parameter_registration_hook(_to_meta)  # type: ignore[arg-type]
    try:
        with _LargeOnMeta():
            yield
    finally:
        handle.remove()


def split_buffers(module: nn.Module) -> dict[str, Tensor]:
    """Move every buffer of ``module`` to meta, returning the real ones by qualified name.

    Afterwards the module is wholly on meta and traces as one (export fakes tensors of one
    device); the returned values are what a layer's buffers are made of when it is measured.
    """
    real: dict[str, Tensor] = {}
    for name, buffer in list(module.named_buffers(remove_duplicate=False)):
        if buffer is None or buffer.device.type == "meta":
            continue
        real[name] = buffer
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        sub._buffers[leaf] = buffer.to("meta")
    return real
