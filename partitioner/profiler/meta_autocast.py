"""Autocast's casting rules on the meta device, where ``torch.autocast`` does not act.

An estimate (:mod:`partitioner.profiler.estimate`) runs every layer on meta tensors, and
``torch.autocast`` refuses the meta device type: under ``--precision bf16`` the layers would run,
and be priced, in float32. :class:`MetaAutocast` applies the rules CUDA autocast applies at the
dispatcher, from the op lists of torch's ``ATen/autocast_mode.h``, one Python call at a time (a
torch-function mode sees both the aten ops of an exported graph and the functional calls of a
module's forward):

- matrix products, convolutions and attention (:data:`LOWER`) cast their float32 tensors to the
  low-precision type; a weight is cast once per region (autocast's cache of weight casts), and the
  cast is differentiable, so autograd saves, and the backward computes in, the low-precision type;
- numerically sensitive ops (:data:`FLOAT32`: softmax, norms, losses, exp, sums) cast to float32;
- ops that mix inputs (:data:`PROMOTE`) cast to the widest floating type among them;
- everything else runs in the dtypes it is given (type promotion decides a mixed elementwise op).

What a Python-level mode cannot see: ops a C++ kernel calls inside itself. A composite the
dispatcher would split into listed ops is listed whole where its result follows (``cross_entropy``
computes ``log_softmax`` and ``nll_loss`` in float32).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from runtime.precision import autocast, compute_dtype

__all__ = ["FLOAT32", "LOWER", "PROMOTE", "MetaAutocast", "autocast_on"]

LOWER = frozenset((
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm",
    "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "__matmul__", "__rmatmul__"
))  # fmt: skip
"""Ops autocast runs in the low-precision type (``AT_FORALL_LOWER_PRECISION_FP``; ``@`` too)."""

FLOAT32 = frozenset((
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "__pow__", "softplus", "layer_norm", "native_layer_norm", "rms_norm",
    "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits",
    "dist", "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa", "prod", "softmax",
    "log_softmax", "_softmax", "_log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum", "cross_entropy", "cross_entropy_loss"
))  # fmt: skip
"""Ops autocast runs in float32 (``AT_FORALL_FP32`` and ``AT_FORALL_FP32_SET_OPT_DTYPE``, with
the composite ``cross_entropy``)."""

PROMOTE = frozenset((
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "tensordot", "scatter_add"
))  # fmt: skip
"""Ops autocast runs in the widest floating type of their inputs (``AT_FORALL_PROMOTE``)."""


class MetaAutocast(TorchFunctionMode):
    """Inside, calls on floating tensors are cast as CUDA autocast to ``dtype`` casts them.

    Example:
        >>> with MetaAutocast(torch.bfloat16):
        ...     y = torch.nn.Linear(4, 4, device="meta")(torch.randn(2, 4, device="meta"))
        >>> y.dtype
        torch.bfloat16
    """

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.weights: dict[int, tuple[Tensor, Tensor]] = {}
        """id of a float32 weight -> the weight (held, so that its id stays its own) and its cast,
        made once in this region (autocast caches the casts of leaves that take a gradient)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if name in LOWER:
            args, kwargs = tree_map(self._lower, (args, kwargs))
        elif name in FLOAT32:
            args, kwargs = tree_map(lambda v: _cast(v, torch.float32), (args, kwargs))
        elif name in PROMOTE:
            floats = [t.dtype for t in tree_flatten((args, kwargs))[0] if _eligible(t)]
            if floats:
                widest = max(floats, key=lambda d: torch.finfo(d).bits)
                args, kwargs = tree_map(lambda v: _cast(v, widest), (args, kwargs))
        return func(*args, **kwargs)

    def _lower(self, value: Any) -> Any:
        if not _eligible(value) or value.dtype == self.dtype:
            return value
        if value.is_leaf and value.requires_grad:  # a weight: cast once, as autocast's cache does
            if id(value) not in self.weights:
                self.weights[id(value)] = (value, value.to(self.dtype))
            return self.weights[id(value)][1]
        return value.to(self.dtype)


def _name(func: Any) -> str:
    """``linear`` for ``aten.linear.default``, ``torch.nn.functional.linear`` and ``Tensor.linear``."""
    opname = getattr(func, "_opname", None)  # an aten OpOverload
    return str(opname) if opname else str(getattr(func, "__name__", ""))


def _eligible(value: Any) -> bool:
    """What autocast casts: floating tensors other than float64."""
    return isinstance(value, Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return value.to(dtype) if _eligible(value) and value.dtype != dtype else value


@contextlib.contextmanager
def autocast_on(precision: str, device: torch.device) -> Iterator[None]:
    """The autocast region a forward on ``device`` runs in under ``precision``: torch's for a real
    device, :class:`MetaAutocast` for the meta device; nothing for fp32."""
    if precision == "fp32" or device.type != "meta":
        with autocast(precision, device):
            yield
        return
    with MetaAutocast(compute_dtype(precision)):
        yield
