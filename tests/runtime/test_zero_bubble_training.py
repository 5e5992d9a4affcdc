"""zb1p's split backward (B: input gradients now, W: weight gradients later) trains exactly as plain
training with gradient accumulation: same gradients, same weights, parameter for parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.runtime.helpers import (
    assert_one_step_is_the_plain_gradient,
    assert_stages_equal,
    plain_training,
    run,
)
from tests.runtime.packages import write_package

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


def test_zb1p_on_2_ranks_gives_plain_gradients(tmp_path: Path) -> None:
    """One SGD step at lr 1: the weights moved by exactly the gradient of plain accumulation."""
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=4, batch_size=8)
    ckpt = tmp_path / "ckpt"
    metrics = run(pkg, steps=1, schedule="zb1p", lr=1.0, checkpoint_dir=str(ckpt))
    assert_one_step_is_the_plain_gradient(pkg, ckpt, 2, 1e-6)
    assert metrics["schedule"] == "zb1p"


def test_zb1p_on_4_ranks_trains_as_plain_training(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1, 1, 1), microbatches=6, batch_size=12)
    ckpt = tmp_path / "ckpt"
    metrics = run(pkg, steps=3, schedule="zb1p", lr=0.1, momentum=0.9, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 3, plain_training(pkg, 3, 6, 12, lr=0.1, momentum=0.9), 4, rtol=1e-6)
    assert len(metrics["losses"]) == 3


def test_zb1p_with_a_skip_connection_and_a_replicated_stage(tmp_path: Path) -> None:
    """Replicas split a minibatch's microbatches as under 1f1b; B and W of a unit stay on one."""
    pkg = write_package(tmp_path / "pkg", "skip", replicas=(2, 1, 1), microbatches=4, batch_size=8)
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=2, schedule="zb1p", optimizer="adam", lr=0.01, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 2, plain_training(pkg, 2, 4, 8, "adam", lr=0.01), 3, rtol=1e-6)
