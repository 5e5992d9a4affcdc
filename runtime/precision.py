"""Mixed precision: which arithmetic the stages' forwards run in, with float32 weights throughout.

``fp32`` runs as written. ``bf16`` and ``fp16`` run every forward (and the loss) under
:func:`torch.autocast` for the rank's device type (``cpu`` or ``cuda``): matrix products and
convolutions compute in the low-precision type, numerically sensitive ops (softmax, losses, norms)
stay in float32, and the parameters, their gradients, the optimizer's state and pipedream's stashed
weight versions stay float32 (autocast casts a weight for each forward that uses it). Backward runs
outside autocast, in the dtypes its forward chose, as torch recommends. Tensors that cross stages
have the dtype the producing stage's forward gave them (usually the low-precision one, half the
bytes of float32).

``fp16`` also needs dynamic loss scaling (:mod:`runtime.executing.loss_scale`); it skips an optimizer step on
every rank at once, which pipedream's stages, stepping at different times on different minibatches,
cannot do, so ``fp16`` needs a synchronous schedule.

Importing this module does not import torch (``partitioner.graph`` checks profiles against
:data:`PRECISIONS` and stays torch-free).

Example:
    >>> with autocast("bf16", "cpu"):
    ...     y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    >>> y.dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from runtime.errors import RunError
from runtime.schedule import REGISTRY

if TYPE_CHECKING:
    import torch

__all__ = ["PRECISIONS", "autocast", "check_precision", "compute_dtype"]

PRECISIONS = ("fp32", "bf16", "fp16")
"""The values of ``--precision``."""


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype autocast computes in: float32, bfloat16 or float16."""
    import torch

    check_precision(precision)
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def check_precision(precision: str, schedule: str | None = None) -> None:
    """Raise a RunError naming a bad ``--precision``, or fp16 under pipedream and what to use instead."""
    if precision not in PRECISIONS:
        raise RunError(f"unknown --precision {precision!r}; choose {', '.join(PRECISIONS)}")
    if precision == "fp16" and schedule in REGISTRY and not REGISTRY[schedule].flushes:
        raise RunError(
            "--precision fp16 needs a synchronous schedule: its loss scaling skips an overflowing step on "
            "every stage at once, but pipedream's stages step at different times on different minibatches; "
            "use --precision bf16 (no loss scaling) with pipedream, or --schedule 1f1b or gpipe with fp16"
        )


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """The context a forward runs in: nothing for fp32, else ``torch.autocast`` to bf16 or fp16."""
    import torch

    dtype = compute_dtype(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)
