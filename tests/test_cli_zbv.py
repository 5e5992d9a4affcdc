"""`pipeplan partition --schedule zbv` writes a package of 2 x GPUs stages laid out as a V that
`pipeplan run` trains; bad requests are one line and exit 2."""

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


@pytest.mark.slow
def test_zbv_plan_lays_stages_as_a_v_and_trains(tmp_path: Path) -> None:
    code, out, _ = _partition(tmp_path, "--schedule", "zbv")
    assert code == 0, out
    pkg = tmp_path / "m" / "tiny-mlp" / "gpus=2"
    plan = load_plan(pkg / "plan.json")
    assert plan.schedule == "zbv" and plan.virtual_stages == 2 and plan.gpus == 2
    assert plan.microbatches == 4  # 2 x GPUs by default
    conf = json.loads((pkg / "mp_conf.json").read_text())
    assert conf["stage_to_rank_map"] == {"0": [0], "1": [1], "2": [1], "3": [0]}
    result = CliRunner().invoke(main, ["run", str(pkg), "--steps", "2", "--timeout", "30"])
    assert result.exit_code == 0, result.output
    metrics = json.loads((pkg / "run" / "metrics.json").read_text())
    assert metrics["schedule"] == "zbv" and metrics["world_size"] == 2 and len(metrics["losses"]) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--schedule", "zbv", "--gpus", "3"], "--schedule zbv on 3 GPUs needs 6 stages"),
        (["--schedule", "zbv", "--virtual-stages", "2"], "--virtual-stages needs --schedule interleaved"),
        (["--schedule", "zbv", "--explain"], "--explain does not support --schedule zbv"),
    ],
)
def test_bad_zbv_requests_exit_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    code, _, err = _partition(tmp_path, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_run_dry_run_takes_schedule_zbv_and_shows_each_ranks_list(tmp_path: Path) -> None:
    from tests.runtime.packages import write_package

    pkg = write_package(
        tmp_path / "pkg", "chain", (1,) * 4, microbatches=2, batch_size=4, virtual=2, v_shape=True
    )
    args = ["run", str(pkg), "--schedule", "zbv", "--steps", "1", "--dry-run"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "# rank 1 (stages 1,2): 1F0 2F0 1F1 2F1 2B0 2W0 1B0 1W0 2B1 2W1 1B1 1W1 1S0 2S0" in result.output
