"""`pipeplan partition --schedule interleaved --virtual-stages V` writes a package of GPUs x V stages on
ranks s mod GPUs that `pipeplan run` trains; bad requests are one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli import main
from partitioner.graph import save_profile
from partitioner.plan import load_plan
from tests.partitioner.codegen_support import profile_for

torch.set_num_threads(1)


def _partition(tmp_path: Path, *args: str, model: str = "tiny-mlp") -> tuple[int, str, str]:
    save_profile(profile_for(model, batch_size=8), tmp_path / "p.json")
    common = ["partition", "--profile", str(tmp_path / "p.json"), "--gpus", "2", "-o", str(tmp_path / "m")]
    result = CliRunner().invoke(main, [*common, *args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_interleaved_plan_lays_stages_on_ranks_s_mod_gpus(tmp_path: Path) -> None:
    code, out, _ = _partition(tmp_path, "--schedule", "interleaved", "--microbatches", "4")
    assert code == 0, out
    pkg = tmp_path / "m" / "tiny-mlp" / "gpus=2"
    plan = load_plan(pkg / "plan.json")
    assert plan.schedule == "interleaved" and plan.virtual_stages == 2 and plan.gpus == 2
    conf = json.loads((pkg / "mp_conf.json").read_text())
    assert conf["stage_to_rank_map"] == {"0": [0], "1": [1], "2": [0], "3": [1]}


@pytest.mark.slow
def test_a_planned_stage_without_weights_trains(tmp_path: Path) -> None:
    """tiny-mlp (5 layers, unmeasured) in 4 stages: one of them is an activation alone; calibrate
    reads the run."""
    code, out, _ = _partition(tmp_path, "--schedule", "interleaved", "--microbatches", "4")
    assert code == 0, out
    pkg = tmp_path / "m" / "tiny-mlp" / "gpus=2"
    assert any(not any(n.startswith("fc") for n in s.nodes) for s in load_plan(pkg / "plan.json").stages)
    result = CliRunner().invoke(main, ["run", str(pkg), "--steps", "2", "--timeout", "30"])
    assert result.exit_code == 0, result.output
    # calibrate reads the run by rank: stages 0 and 2 timed together on rank 0, 1 and 3 on rank 1
    args = ["calibrate", str(pkg), "--accept-load", "-o", str(tmp_path / "c.json")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "0+2" in result.stdout and "1+3" in result.stdout and (tmp_path / "c.json").exists()


@pytest.mark.slow
def test_interleaved_package_with_a_skip_across_chunks_runs(tmp_path: Path) -> None:
    """tiny-skip cut so that stage 0 (rank 0) sends to stage 1 and, skipping, to stage 3 (both on
    rank 1): two streams between one pair of ranks, in different orders."""
    args = [
        "--schedule",
        "interleaved",
        "--microbatches",
        "4",
        "--cuts",
        "act,relu,l3",
        "--replicas",
        "1,1,1,1",
    ]
    code, out, _ = _partition(tmp_path, *args, model="tiny-skip")
    assert code == 0, out
    pkg = tmp_path / "m" / "tiny-skip" / "gpus=2"
    assert load_plan(pkg / "plan.json").virtual_stages == 2
    result = CliRunner().invoke(main, ["run", str(pkg), "--steps", "3", "--timeout", "30"])
    assert result.exit_code == 0, result.output
    metrics = json.loads((pkg / "run" / "metrics.json").read_text())
    assert metrics["schedule"] == "interleaved" and metrics["world_size"] == 2
    assert len(metrics["losses"]) == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--schedule", "1f1b", "--virtual-stages", "2"], "--virtual-stages needs --schedule interleaved"),
        (["--schedule", "interleaved", "--microbatches", "3"], "multiple of the 2 ranks"),
        (["--schedule", "interleaved", "--virtual-stages", "4"], "needs 8 stages"),
        (["--schedule", "interleaved", "--virtual-stages", "0"], "must be >= 1"),
        (["--schedule", "interleaved", "--explain"], "--explain does not support"),
        (["--schedule", "interleaved", "--gpus", "1"], "at least 2 GPUs"),
    ],
)
def test_bad_interleaved_requests_exit_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    code, _, err = _partition(tmp_path, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_run_dry_run_takes_schedule_interleaved_and_shows_each_ranks_list(tmp_path: Path) -> None:
    from tests.runtime.packages import write_package

    pkg = write_package(tmp_path / "pkg", "chain", (1,) * 4, microbatches=2, batch_size=4, virtual=2)
    args = ["run", str(pkg), "--schedule", "interleaved", "--steps", "1", "--dry-run"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "# rank 1 (stages 1,3): 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 1S0 3S0" in result.output
