"""The split backward: B's input gradients and W's weight gradients are exactly a plain backward's,
and W does not run the input-gradient chain again."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from runtime.executing.split_backward import backward_input, backward_weight


class _Count(torch.autograd.Function):
    """Identity whose backward counts how often it runs."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _Count.calls += 1
        return g


class _Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = _Count.apply(torch.tanh(layer(x)))
        return x


class _Shared(nn.Module):
    """A weight used twice and a bias read by the output directly: the plain way for those."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(torch.tanh(self.a(x))))) + self.b.bias.sum()


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(6, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.fc, self.scale = nn.Linear(4 * 4 * 4, 6), nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.norm(self.conv(x.view(-1, 6, 4, 4)))).flatten(1)) * self.scale


def _plain(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    xi = x.clone().requires_grad_(True)
    module(xi).backward(g)
    assert xi.grad is not None
    grads = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    module.zero_grad(set_to_none=True)
    return xi.grad, grads


@pytest.mark.parametrize("make", [_Counted, _Shared, _Conv])
def test_split_equals_a_plain_backward(make: type[nn.Module]) -> None:
    torch.manual_seed(0)
    module = make()
    x = torch.randn(4, 6 * 16) if make is _Conv else torch.randn(4, 6)
    g = torch.randn_like(module(x))
    want_x, want = _plain(module, x, g)
    xi = x.clone().requires_grad_(True)
    (got_x,), work = backward_input([module(xi)], [g], [xi], list(module.parameters()))
    got = dict(backward_weight(work))
    torch.testing.assert_close(got_x, want_x, rtol=0, atol=1e-6)
    assert len(got) == len(want)
    for p, w in zip(module.parameters(), want, strict=True):
        torch.testing.assert_close(got[p], w, rtol=0, atol=1e-6)
    assert all(p.grad is None for p in module.parameters())  # W returns, the caller accumulates


def test_w_does_not_run_the_input_chain_again() -> None:
    module = _Counted()
    xi = torch.randn(3, 6, requires_grad=True)
    _Count.calls = 0
    _, work = backward_input([module(xi).sum()], [None], [xi], list(module.parameters()))
    assert _Count.calls == 4 and len(work.boundary) == 4 and not work.rest
    backward_weight(work)
    assert _Count.calls == 4  # autograd.grad(roots, params) would have run all four again


def test_shared_weight_takes_the_plain_way() -> None:
    module = _Shared()
    xi = torch.randn(3, 6, requires_grad=True)
    _, work = backward_input([module(xi).sum()], [None], [xi], list(module.parameters()))
    assert {id(p) for p in work.rest} == {id(module.a.weight), id(module.a.bias), id(module.b.bias)}


def test_no_inputs_leaves_the_whole_backward_to_w() -> None:
    layer = nn.Linear(3, 2)
    got, work = backward_input([layer(torch.randn(2, 3)).sum()], [None], [], list(layer.parameters()))
    assert got == () and len(work.rest) == 2 and not work.boundary
    assert len(backward_weight(work)) == 2
