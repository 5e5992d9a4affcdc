"""Autocast's casting rules on meta tensors, where torch.autocast does not act."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from partitioner.profiler.meta_autocast import MetaAutocast, autocast_on


def _meta(*shape: int, grad: bool = False) -> torch.Tensor:
    return torch.empty(*shape, device="meta", requires_grad=grad)


def test_products_run_low_sensitive_ops_float32_the_rest_as_given() -> None:
    x, w = _meta(4, 8), nn.Parameter(_meta(8, 8))
    with MetaAutocast(torch.bfloat16):
        y = F.linear(x, w)
        assert y.dtype == torch.bfloat16 and (x @ w).dtype == torch.bfloat16
        assert torch.ops.aten.mm.default(x, w).dtype == torch.bfloat16  # an exported graph's aten op
        assert F.softmax(y, -1).dtype == torch.float32 and F.layer_norm(y, (8,)).dtype == torch.float32
        assert F.cross_entropy(y, torch.zeros(4, dtype=torch.long, device="meta")).dtype == torch.float32
        assert torch.relu(y).dtype == torch.bfloat16 and (y + x).dtype == torch.float32  # type promotion
        assert torch.addcmul(x, y, y).dtype == torch.float32  # promote: the widest input
        assert F.linear(x.double(), w.double()).dtype == torch.float64  # float64 is never cast
    assert F.linear(x, w).dtype == torch.float32  # outside: nothing


def test_a_weight_is_cast_once_per_region_and_the_cast_is_differentiable() -> None:
    w = nn.Parameter(_meta(8, 8))
    x = _meta(4, 8)
    with MetaAutocast(torch.bfloat16) as region:
        y = F.linear(F.linear(x, w), w)
    assert len(region.weights) == 1
    (gw,) = torch.autograd.grad(y.sum(), [w])
    assert gw.dtype == torch.float32 and gw.shape == w.shape  # the cast's backward returns float32


def test_real_devices_get_torch_autocast() -> None:
    with autocast_on("bf16", torch.device("cpu")):
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.bfloat16
    with autocast_on("fp32", torch.device("meta")):
        assert F.linear(_meta(2, 4), _meta(4, 4)).dtype == torch.float32
    with autocast_on("fp16", torch.device("meta")):
        assert F.linear(_meta(2, 4), _meta(4, 4)).dtype == torch.float16
