"""Building without weights: parameters on meta, buffers real, ties kept, nothing large allocated."""

from __future__ import annotations

import torch
from torch import nn

from runtime.building.meta_params import LARGE, split_buffers, weightless


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 100, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("positions", torch.arange(16))
        self.register_buffer("table", torch.zeros(LARGE + 1))  # too large to build: meta


def test_parameters_go_to_meta_and_buffers_keep_their_values() -> None:
    with weightless():
        net = _Net()
    assert {p.device.type for p in net.parameters()} == {"meta"}
    assert net.head.weight is net.embed.weight
    assert net.positions.device.type == "cpu" and net.positions.tolist() == list(range(16))
    assert net.norm.running_var.tolist() == [1.0] * 8
    assert net.table.device.type == "meta"  # a constructor's large tensor is never allocated
    with weightless():
        big = nn.Linear(1 << 14, 1 << 14)  # 1 GiB of float32 if it were real
    assert big.weight.device.type == "meta" and big.weight.requires_grad
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # outside, nothing changes


def test_split_buffers_leaves_the_module_on_meta() -> None:
    with weightless():
        net = _Net()
    real = split_buffers(net)
    assert set(real) == {"positions", "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    assert real["positions"].tolist() == list(range(16))
    assert {t.device.type for t in [*net.parameters(), *net.buffers()]} == {"meta"}
