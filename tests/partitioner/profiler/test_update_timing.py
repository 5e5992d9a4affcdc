"""Timing the optimizer update per parameter byte."""

from __future__ import annotations

import torch
from torch import nn

from partitioner.profiler.update_timing import measure_update


def test_rates_for_every_optimizer_and_the_module_is_left_alone() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    before = [p.detach().clone() for p in module.parameters()]
    rates = measure_update(module, repeats=2)
    assert set(rates) == {"sgd", "momentum", "adam", "adamw"}
    assert all(rate > 0 for rate in rates.values())
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before, strict=True))
    assert all(p.grad is None for p in module.parameters())


def test_no_weights_no_rates() -> None:
    assert measure_update(nn.ReLU()) == {}
