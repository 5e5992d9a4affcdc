"""``pipeplan verify`` of a 3D package on real ranks (4 gloo ranks): the user's MLP file (residual
blocks split column- then row-wise) as PP2 x TP2, PP2 x DP2 fully sharded and the latter as zbv's
V matches the plain stages; a tensor-parallel weight shard swapped on one stage, and FSDP2
averaging the copies' gradients instead of summing them, are mismatches naming their stages; a
rank that fails is one line naming it and its log."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from cli import main
from partitioner.errors import PackageError
from partitioner.verification.on_ranks import verify_on_ranks
from partitioner.verification.verify import ATOL
from tests.runtime.packages3d import generate_3d

profiler = pytest.importorskip("partitioner.profiler.profile")

pytestmark = pytest.mark.slow

MLP_FILE = Path(__file__).parents[2] / "runtime" / "mlp3d_model.py"
TP2, DP2_FULL = [(2, 1, "none")] * 2, [(1, 2, "full")] * 2

# Planted in a package's __init__.py, which every rank imports before it builds its stage (the parent
# process, which has no RANK, is left alone): the runtime's own building, changed as a bug would.
SWAP_SHARDS = """
import os as _os
if _os.environ.get("RANK") is not None:
    import runtime.job.stage3d as _stage3d
    _split = _stage3d.split_stage

    def _swapped(module, plan, mesh, group, tensor_rank, stage):  # stage 1 holds the other rank's shards
        other = (tensor_rank + 1) % mesh.size() if stage == 1 else tensor_rank
        return _split(module, plan, mesh, group, other, stage)

    _stage3d.split_stage = _swapped
"""
AVERAGE_COPIES = """
import os as _os
if _os.environ.get("RANK") is not None:
    import runtime.job.stage3d as _stage3d
    _shard = _stage3d.shard_stage

    def _averaged(*args, **kwargs):  # FSDP2's default: the copies' gradients averaged, not summed
        module = _shard(*args, **kwargs)
        module.set_gradient_divide_factor(2.0)
        return module

    _stage3d.shard_stage = _averaged
"""
FAIL_STAGE_1 = """
import os as _os
if _os.environ.get("RANK") is not None:
    import runtime.job.stage3d as _stage3d
    _split = _stage3d.split_stage

    def _fails(module, plan, mesh, group, tensor_rank, stage):
        if stage == 1:
            raise RuntimeError(f"planted failure splitting stage {stage}")
        return _split(module, plan, mesh, group, tensor_rank, stage)

    _stage3d.split_stage = _fails
"""


@pytest.fixture(scope="module")
def mlp() -> Any:
    torch.set_num_threads(1)
    return profiler.profile_model(f"{MLP_FILE}:model", batch_size=8, repeats=1)


def _planted(tmp: Path, profile: Any, layouts: list[tuple[int, int, str]], plant: str = "") -> Path:
    pkg = generate_3d(tmp / "pkg", profile, layouts, "1f1b", 4, 8)
    if plant:
        init = pkg / "__init__.py"
        init.write_text(init.read_text(encoding="utf-8") + plant, encoding="utf-8")
    return pkg


def test_pp2_tp2_matches_on_4_ranks(tmp_path: Path, mlp: Any) -> None:
    """`pipeplan verify` of PP2 x TP2: the one-process table, then a row per stage from its ranks."""
    pkg = _planted(tmp_path, mlp, TP2)
    result = CliRunner().invoke(main, ["verify", str(pkg)])
    assert result.exit_code == 0, result.output
    assert "on 4 gloo ranks" in result.output and "TP2" in result.output
    assert result.output.count("yes") == 4  # two stages in one process, two on their ranks
    assert result.output.strip().splitlines()[-1].startswith("match: ")
    assert (pkg / "verify" / "logs" / "launcher.log").is_file() and not (pkg / "verify" / "cases").exists()


def test_pp2_dp2_full_matches_on_4_ranks(tmp_path: Path, mlp: Any) -> None:
    """PP2 x DP2 fully sharded: each copy runs half the minibatch, FSDP2 gathers the weights and
    sums the gradients; gathered whole, they are the plain stages'."""
    report = verify_on_ranks(_planted(tmp_path, mlp, DP2_FULL))
    assert report.ok and report.world_size == 4 and report.batch_size == 8
    assert [(s.index, s.layout, s.ranks) for s in report.stages] == [
        (0, "DP2 fsdp", (0, 1)),
        (1, "DP2 fsdp", (2, 3)),
    ]
    for s in report.stages:
        assert s.init_error == 0.0 and s.grad_error <= ATOL and s.params > 0


def test_zbv_fully_sharded_v_matches(tmp_path: Path, mlp: Any) -> None:
    """zbv with copies: each rank hosts two stages of the V (both checked), FSDP2 held gathered
    through the backward and its gradients reduced by hand, as the runtime does under a split
    backward."""
    pkg = generate_3d(tmp_path / "zbv", mlp, [(1, 2, "full")] * 4, "zbv", 4, 8)
    report = verify_on_ranks(pkg)
    assert report.ok and report.world_size == 4
    assert [s.ranks for s in report.stages] == [(0, 1), (2, 3), (2, 3), (0, 1)]


def test_a_swapped_weight_shard_is_a_mismatch_naming_its_stage(tmp_path: Path, mlp: Any) -> None:
    """Stage 1's tensor ranks holding each other's shards compute the same outputs (fc1's and fc2's
    halves swap together), so only the weights and gradients gathered whole show it."""
    pkg = _planted(tmp_path, mlp, TP2, SWAP_SHARDS)
    report = verify_on_ranks(pkg)
    first, second = report.stages
    assert first.ok and not report.ok and not second.ok and second.failed == (2, 3)
    assert second.init_error > 0.1 and second.grad_error > 1e-3
    assert second.output_error <= ATOL  # (the outputs alone would have passed)
    result = CliRunner().invoke(main, ["verify", str(pkg)])
    assert result.exit_code == 1, result.output
    assert "MISMATCH on ranks: stage 1 (TP2) on ranks 2, 3" in result.output


def test_averaged_copies_are_a_mismatch_on_every_sharded_stage(tmp_path: Path, mlp: Any) -> None:
    """FSDP2 dividing the summed gradients by the copies (its default, which the runtime turns off):
    the weights and outputs still match, every stage's gradients are half the plain stages'."""
    report = verify_on_ranks(_planted(tmp_path, mlp, DP2_FULL, AVERAGE_COPIES))
    assert not report.ok and all(not s.ok for s in report.stages)
    assert all(s.init_error == 0.0 and s.output_error <= ATOL and s.grad_error > 1e-3 for s in report.stages)


def test_a_failing_rank_is_one_line_naming_it(tmp_path: Path, mlp: Any) -> None:
    pkg = _planted(tmp_path, mlp, TP2, FAIL_STAGE_1)
    with pytest.raises(PackageError) as caught:
        verify_on_ranks(pkg)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("verify on 4 gloo ranks: rank ")
    assert re.search(
        r"rank [23] \(stage 1\) failed: .*RuntimeError.*planted failure splitting stage 1; log: ", message
    )
