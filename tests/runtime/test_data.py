"""Synthetic minibatches: drawn once per distinct step, kept while they fit, the same values either way."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from runtime.datasets.minibatches import SYNTHETIC_STEPS, SyntheticBatches


def _package(calls: list[int]) -> SimpleNamespace:
    def example_inputs(batch_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
        calls.append(seed)
        return {"x": torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(seed))}

    def example_targets(batch_size: int, seed: int = 0) -> torch.Tensor:
        return torch.randint(0, 3, (batch_size,), generator=torch.Generator().manual_seed(seed + 1))

    return SimpleNamespace(example_inputs=example_inputs, example_targets=example_targets)


def test_each_distinct_step_is_drawn_once() -> None:
    calls: list[int] = []
    batches = SyntheticBatches(_package(calls), ["x"], 4, seed=3)
    first = [batches.inputs(s)[0].clone() for s in range(SYNTHETIC_STEPS)]
    again = [batches.inputs(s + SYNTHETIC_STEPS)[0] for s in range(SYNTHETIC_STEPS)]
    assert len(calls) == SYNTHETIC_STEPS
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert torch.equal(batches.targets(1), batches.targets(1 + SYNTHETIC_STEPS))


def test_minibatches_over_the_limit_are_drawn_again_with_the_same_values() -> None:
    calls: list[int] = []
    batches = SyntheticBatches(_package(calls), ["x"], 4, seed=3, keep_bytes=0)
    kept = SyntheticBatches(_package([]), ["x"], 4, seed=3)
    for step in (0, 1, SYNTHETIC_STEPS, SYNTHETIC_STEPS + 1):
        assert torch.equal(batches.inputs(step)[0], kept.inputs(step)[0])
    assert len(calls) == 4
