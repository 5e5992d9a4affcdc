"""The one-rank 3D check's own verdicts: a difference beyond the tolerance, a renamed weight and a
failing path are each reported as such (its paths themselves run in tests/benchmarks/test_gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_3d_one_rank as one_rank


def test_a_weight_off_by_more_than_the_tolerance_is_different() -> None:
    want = {"w": torch.tensor([2.0, -4.0])}
    close = {"w": torch.tensor([2.0, -4.0 + 2e-5])}  # 5e-6 of the largest value
    far = {"w": torch.tensor([2.0 + 1e-3, -4.0])}
    assert one_rank.verdict(one_rank.max_rel_error(close, want), "fp32") == "equal"
    assert one_rank.verdict(one_rank.max_rel_error(far, want), "fp32") == "DIFFERENT"
    assert one_rank.verdict(one_rank.max_rel_error(far, want), "bf16") == "equal"


def test_a_weight_missing_or_reshaped_is_an_error_not_a_pass() -> None:
    want = {"w": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match="parameters differ"):
        one_rank.max_rel_error({"v": torch.zeros(2, 2)}, want)
    with pytest.raises(ValueError, match="shape"):
        one_rank.max_rel_error({"w": torch.zeros(4)}, want)


def test_a_failing_path_is_recorded_with_its_error() -> None:
    def boom() -> dict[str, object]:
        raise RuntimeError("NCCL error: invalid usage")

    row = one_rank.recorded(boom)
    assert row["ran"] is False and row["result"] == "error"
    assert row["error"] == "RuntimeError: NCCL error: invalid usage" and row["wall_s"] >= 0
    assert one_rank.recorded(lambda: {"result": "built"})["ran"] is True


def test_every_shard_level_and_both_precisions_have_a_path() -> None:
    from runtime.packages.layout3d import SHARD_LEVELS

    ways = one_rank.WAYS
    assert {w.shard for w in ways} == set(SHARD_LEVELS)
    assert {w.precision for w in ways} == set(one_rank.TOLERANCE) == {"fp32", "bf16"}
    assert any(w.checkpoint and w.tensor for w in ways)
    assert any(w.checkpoint and w.shard != "none" for w in ways)
    assert one_rank.PATHS[0] == "mesh" and one_rank.PATHS[1:] == tuple(w.name for w in ways)
    assert len(set(one_rank.PATHS)) == len(one_rank.PATHS)
