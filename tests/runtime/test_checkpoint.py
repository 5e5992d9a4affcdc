"""Which step ``--resume`` continues after: complete, readable, of this package; temp files removed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from runtime import checkpoint
from runtime.errors import RunError
from runtime.launch import resolve_resume
from runtime.options import RunOptions
from tests.runtime.packages import write_package


def _step(root: Path, pkg: Path, step: int, stages: int = 2, meta: bool = True) -> None:
    """A complete checkpoint of ``step`` (one rank per stage), as the ranks write it."""
    for k in range(stages):
        checkpoint.save_stage(root, step, k, {"model": {"w": torch.ones(3)}, "optimizer": {}, "step": step})
        checkpoint.save_rank(root, step, k)
    if meta:
        checkpoint.save_meta(root, step, pkg, stages)


@pytest.fixture
def pkg(tmp_path: Path) -> Path:
    return write_package(tmp_path / "pkg", "chain", replicas=(1, 1))


def test_newest_complete_step_is_chosen(tmp_path: Path, pkg: Path) -> None:
    root = tmp_path / "ck"
    _step(root, pkg, 2)
    _step(root, pkg, 4)
    assert checkpoint.resume_point(root, pkg, 2, 2) == checkpoint.ResumePoint(4)


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "unreadable"),
        (lambda p: p.write_bytes(b""), "unreadable"),
        (lambda p: p.unlink(), "incomplete, no stage1.pt"),
    ],
    ids=["truncated", "zero bytes", "missing"],
)
def test_a_damaged_newest_step_falls_back_to_the_one_before(
    tmp_path: Path, pkg: Path, damage: Callable[[Path], object], why: str
) -> None:
    root = tmp_path / "ck"
    _step(root, pkg, 2)
    _step(root, pkg, 4)
    damage(root / "step-4" / "stage1.pt")
    point = checkpoint.resume_point(root, pkg, 2, 2)
    assert point.step == 2 and len(point.skipped) == 1
    assert point.skipped[0].startswith("step-4: ") and why in point.skipped[0]


def test_a_step_without_meta_is_torn_and_temp_files_are_removed(tmp_path: Path, pkg: Path) -> None:
    root = tmp_path / "ck"
    _step(root, pkg, 2)
    _step(root, pkg, 3, meta=False)
    stale = root / "step-3" / ".stage0.pt.12345.tmp"
    stale.write_bytes(b"half")
    point = checkpoint.resume_point(root, pkg, 2, 2)
    assert (point.step, point.removed) == (2, 1) and not stale.exists()


def test_a_checkpoint_of_another_package_is_refused(tmp_path: Path, pkg: Path) -> None:
    other = write_package(tmp_path / "other", "chain", replicas=(1, 1, 1))
    root = tmp_path / "ck"
    _step(root, other, 2, stages=2)
    with pytest.raises(RunError, match=r"step-2 was written by the package .*other.*not by"):
        checkpoint.resume_point(root, pkg, 2, 2)


def test_resume_says_where_it_continues_or_that_there_is_nothing(tmp_path: Path, pkg: Path) -> None:
    root = tmp_path / "ck"
    options = RunOptions(str(pkg), resume=True, checkpoint_dir=str(root))
    resolved, notes = resolve_resume(options)
    assert resolved.resume_step == 0 and notes == [f"no usable checkpoint in {root}: starting from step 0"]
    _step(root, pkg, 6)
    resolved, notes = resolve_resume(options)
    assert resolved.resume_step == 6 and notes == [f"resuming after step 6 from {root}/step-6"]
