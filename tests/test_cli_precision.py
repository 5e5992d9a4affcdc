"""`--precision` through the CLI: profile measures under autocast and records it, partition carries it
into plan.json, run defaults to it and says when told otherwise; bad values are one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli import main
from partitioner.graph import load_profile, profile_to_json
from partitioner.profiler.profile import profile_model
from tests.runtime.packages import write_package

torch.set_num_threads(1)


def _one_error_line(args: list[str]) -> str:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error:") and len(result.output.strip().splitlines()) == 1, result.output
    return result.output


def test_precision_flows_from_profile_to_plan_to_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    result = runner.invoke(main, ["profile", "tiny-mlp", "--repeats", "1", "--precision", "fp16"])
    assert result.exit_code == 0, result.output
    assert "fp16 autocast" in result.output
    profile = json.loads(Path("profiles/tiny-mlp/profile.json").read_text())
    assert profile["precision"] == "fp16"
    assert "needs a synchronous schedule" in _one_error_line(["partition", "--gpus", "2"])
    result = runner.invoke(main, ["partition", "--gpus", "2", "--schedule", "1f1b"])
    assert result.exit_code == 0, result.output
    package = Path("models/tiny-mlp/gpus=2")
    assert json.loads((package / "plan.json").read_text())["precision"] == "fp16"
    result = runner.invoke(main, ["run", "--dry-run"])
    assert result.exit_code == 0 and "note:" not in result.output, result.output
    result = runner.invoke(main, ["run", "--dry-run", "--precision", "bf16"])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "training at bf16, but the plan was made for fp16" in notes[0]
    assert "--precision bf16" in result.output  # the ranks' command line carries it


def test_profiles_written_before_precision_read_as_fp32(tmp_path: Path) -> None:
    doc = profile_to_json(profile_model("tiny-mlp", batch_size=4, repeats=1))
    doc.pop("precision")
    for node in doc["nodes"]:
        node.pop("cast_bytes")
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    assert load_profile(path).precision == "fp32"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["profile", "tiny-mlp", "--precision", "fp8"], "--precision"),
        (["profile", "tiny-mlp", "--precision", "bf16", "--dtype", "bfloat16"], "give one of the two"),
        (["run", "{pkg}", "--dry-run", "--precision", "half"], "--precision"),
        (["run", "{pkg}", "--dry-run", "--precision", "fp16", "--schedule", "pipedream"], "--schedule 1f1b"),
    ],
)
def test_bad_precision_exits_2_with_one_line(tmp_path: Path, args: list[str], words: str) -> None:
    pkg = write_package(tmp_path / "pkg", replicas=(1, 1))
    assert words in _one_error_line([a.format(pkg=pkg) for a in args])
