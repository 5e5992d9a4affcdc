"""Small models for code generation tests: graph shapes the zoo does not have."""

from __future__ import annotations

import torch
from torch import nn


class SizeLater(nn.Module):
    """A size read in the first layer and used by the last (``view(n, ...)``): it must not cross stages."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 8)
        self.l2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        h = torch.relu(self.l1(x))
        h = torch.relu(self.l2(h))
        out: torch.Tensor = self.head(h).view(n, -1)
        return out


def size_later() -> SizeLater:
    return SizeLater()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 6, generator=torch.Generator().manual_seed(0)),)


class PlainTensor(nn.Module):
    """Reads a tensor attribute that is neither a parameter nor a buffer: stages could not rebuild it."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 5)
        self.offset = torch.ones(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.l1(x) + self.offset
        return out


def plain_tensor() -> PlainTensor:
    return PlainTensor()


class InPlace(nn.Module):
    """Writes tensors in place three ways (a module's ``inplace=True``, ``+=``, a ``_`` method): a stage
    whose first node does so would write into a received autograd leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 8)
        self.act = nn.ReLU(inplace=True)
        self.l2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.l1(x))
        g = self.l2(h)
        g += h
        out: torch.Tensor = self.head(g.relu_())
        return out


def in_place() -> InPlace:
    return InPlace()


class Dropouts(nn.Module):
    """Functional dropout and attention dropout that follow ``self.training``, as GPT-2 writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(torch.relu(self.l1(x)), 0.5, training=self.training)
        q = self.l2(h).view(-1, 2, 2, 2)
        p = 0.3 if self.training else 0.0
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=p)
        out: torch.Tensor = self.head(a.flatten(1))
        return out


def dropouts() -> Dropouts:
    return Dropouts()
