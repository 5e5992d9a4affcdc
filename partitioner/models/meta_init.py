"""Building a model on the meta device without running its random initialisation.

Why: torch's meta kernels of the random in-place ops (``normal_``, ``uniform_``, ...) are Python
references wrapped to keep dynamo out, and the first call of one imports ``torch._dynamo``: about a
second of CPU (several on a loaded machine) in a ``pipeplan partition`` that builds the model only
for its structure and shapes. A meta tensor has no values to fill, so returning it unchanged is what
the op would have done.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.nn import init
from torch.overrides import TorchFunctionMode

__all__ = ["SkipMetaInit"]

_RANDOM_FILLS = frozenset({
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.random_,
    torch.Tensor.exponential_, torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.geometric_,
    # torch.nn.init's fills dispatch as themselves, and the tensor methods they call then run with this
    # mode off (a mode is off inside its own handler)
    init.normal_, init.uniform_, init.trunc_normal_, init.kaiming_normal_, init.kaiming_uniform_,
    init.xavier_normal_, init.xavier_uniform_, init.orthogonal_, init.sparse_,
})  # fmt: skip


class SkipMetaInit(TorchFunctionMode):
    """Within the block, a random fill of a meta tensor returns the tensor; everything else runs."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:
            target = args[0] if args else kwargs.get("tensor")  # (torch.nn.init passes it by name)
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)
