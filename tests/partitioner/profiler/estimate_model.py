"""Tiny models whose FLOPs and bytes are known by hand, for the estimator's tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_a = nn.Linear(64, 32)
        self.act = nn.ReLU()
        self.fc_b = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_b(self.act(self.fc_a(x)))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(y.transpose(1, 2).reshape(b, n, 16)).mean(1)


def mlp() -> tuple[nn.Module, torch.Tensor]:
    return Mlp(), torch.randn(8, 64)


def attention() -> tuple[nn.Module, torch.Tensor]:
    return Attention(), torch.randn(4, 32, 16)
