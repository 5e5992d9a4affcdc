"""A small transformer-like model of identical blocks, for the reuse and layer-by-layer tests."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Blocks(nn.Module):
    def __init__(self, depth: int, width: int = 32, vocab: int = 50, wide: int | None = None) -> None:
        """``wide``: the index of one block whose hidden layer is twice as wide (it differs)."""
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        if wide is not None:
            self.blocks[wide].up = nn.Linear(width, 8 * width)
            self.blocks[wide].down = nn.Linear(8 * width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def four() -> nn.Module:
    return Blocks(4)


def eight() -> nn.Module:
    return Blocks(8)


def four_one_wide() -> nn.Module:
    return Blocks(4, wide=2)


def example_inputs(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 50, (batch_size, 6), generator=torch.Generator().manual_seed(0))
