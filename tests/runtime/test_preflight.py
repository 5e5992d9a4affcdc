"""The launcher's dry run of the first stage refuses data it cannot read, and nothing else."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from runtime.errors import RunError
from runtime.job.preflight import check_first_stage, check_inputs_match


class _DataDependent(nn.Module):
    """A stage whose forward reads a value (fine on real tensors, impossible on the meta device)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * float(x.abs().max().item() > 0)


def _package(stage: type[nn.Module]) -> SimpleNamespace:
    return SimpleNamespace(model=lambda criterion: [(stage(), ["x"], ["y"])], criterion=nn.MSELoss)


def test_data_dependent_stages_are_not_refused() -> None:
    check_first_stage(_package(_DataDependent), [torch.randn(3, 4)], "synthetic")  # type: ignore[arg-type]


def test_inputs_the_first_stage_cannot_read_are_refused() -> None:
    with pytest.raises(RunError, match=r"cannot read minibatch 0 of shape \(3, 5\)"):
        check_first_stage(_package(_DataDependent), [torch.randn(3, 5)], "d.py:f")  # type: ignore[arg-type]


def test_batch_rows_rank_and_dtype_must_match_the_plan() -> None:
    planned = [{"name": "x", "shape": [8, 4], "dtype": "float32"}]
    check_inputs_match(["x"], [torch.randn(8, 4)], planned, 8, "d")
    for bad, why in [(torch.randn(7, 4), r"\(7, 4\)"), (torch.randn(8, 4, 1), "expects"),
                     (torch.randn(8, 4, dtype=torch.float64), "float64")]:  # fmt: skip
        with pytest.raises(RunError, match=why):
            check_inputs_match(["x"], [bad], planned, 8, "d")
