"""`pipeplan profile`: files written, --json, one-line errors with exit code 2, a help that skips torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli import main
from cli_render.progress import PhaseLog
from partitioner.graph import load_profile

ROOT = Path(__file__).resolve().parents[1]

PROGRESS = PhaseLog.PATTERN  # progress lines a command printed before its error


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.chdir(tmp_path)
    return CliRunner()


def test_profile_writes_the_default_path_and_prints_a_summary(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(
        main, ["profile", "tiny-cnn", "--batch-size", "2", "--repeats", "1", "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    path = tmp_path / "profiles" / "tiny-cnn" / "profile.json"
    profile = load_profile(path)
    assert (
        profile.model == "tiny-cnn" and profile.batch_size == 2 and profile.inputs[0].shape == (2, 3, 16, 16)
    )
    assert (
        "fidelity" in result.output
        and "conv_a" in result.output
        and str(path.relative_to(tmp_path)) in result.output
    )


def test_profile_json_and_options(runner: CliRunner, tmp_path: Path) -> None:
    args = ["profile", "tiny-gpt", "-o", "out/p.json", "--json", "--repeats", "1", "--input-shape", "12"]
    threads = torch.get_num_threads()
    result = runner.invoke(main, [*args, "--batch-size", "3", "--leaf-module", "Block", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert torch.get_num_threads() == threads  # restored after measuring
    doc = json.loads(result.stdout)
    assert doc["extra"]["threads"] == 1
    assert doc["schema"] == "pipeplan.profile/1" and doc["inputs"][0]["shape"] == [3, 12]
    assert doc["tracer_options"]["leaf_modules"] == ["Block"]
    assert [n["target"] for n in doc["nodes"]].count("Block") == 2
    assert load_profile(tmp_path / "out" / "p.json").batch_size == 3


def test_profile_overwrites_its_own_profile(runner: CliRunner) -> None:
    for _ in range(2):
        result = runner.invoke(main, ["profile", "tiny-mlp", "-o", "p.json", "--repeats", "1"])
        assert result.exit_code == 0, result.output


BROKEN = """
def make():
    raise ValueError("no such layer size")
"""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nosuchmodel"], "unknown model 'nosuchmodel'"),
        (["tiny-cnn", "--input-shape", "3,x,16"], "bad --input-shape"),
        (["tiny-cnn", "--input-shape", "3,-1,16"], "bad --input-shape"),
        (["tiny-cnn", "--batch-size", "0"], "--batch-size must be positive"),
        (["tiny-cnn", "--threads", "0"], "--threads must be positive"),
        (["tiny-cnn", "-o", "/proc/nope/profile.json"], "cannot write"),
        (["tiny-cnn", "-o", "."], "is a folder"),
        (["tiny-cnn", "--leaf-module", "Nothing"], "matches no module"),
        (["BROKEN"], "raised ValueError: no such layer size"),
        (["tiny-cnn", "-o", "foreign.json"], "refusing to overwrite foreign.json"),
        (["tiny-cnn", "-o", "corrupt.json"], "refusing to overwrite corrupt.json"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    runner: CliRunner, tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "broken.py").write_text(textwrap.dedent(BROKEN))
    (tmp_path / "foreign.json").write_text('{"schema": "someone.else/3"}')
    (tmp_path / "corrupt.json").write_text('{"schema": "pipeplan.profile/1", "nodes": [')
    args = [str(tmp_path / "broken.py") + ":make" if a == "BROKEN" else a for a in args]
    result = runner.invoke(main, ["profile", *args, "--repeats", "1"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip() and not re.match(PROGRESS, line)]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.output
    assert (tmp_path / "foreign.json").read_text() == '{"schema": "someone.else/3"}'


def test_a_module_branching_on_values_is_kept_whole_and_a_root_branch_is_one_error_line(
    runner: CliRunner, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "gated.py").write_text(
        textwrap.dedent(
            """
            import torch
            class Gate(torch.nn.Module):
                def forward(self, x):
                    return x if x.sum() > 0 else -x
            def make():
                return torch.nn.Sequential(torch.nn.Linear(4, 4), Gate()), torch.randn(2, 4)
            def root():
                return Gate(), torch.randn(2, 4)
            """
        )
    )
    result = runner.invoke(main, ["profile", f"{tmp_path / 'gated.py'}:make", "--repeats", "1"])
    assert result.exit_code == 0, result.output  # fx fails in Gate; torch.export keeps it whole
    assert "1 (Gate) branches on a tensor's value at gated.py:5: kept whole" in caplog.text
    refused = runner.invoke(main, ["profile", f"{tmp_path / 'gated.py'}:root", "--repeats", "1"])
    lines = [line for line in refused.output.splitlines() if line.strip() and not re.match(PROGRESS, line)]
    assert refused.exit_code == 2 and len(lines) == 1, refused.output  # no torch.export graph dumps
    assert "<root> (Gate) branches on a tensor's value at" in lines[0] and "gated.py:5" in lines[0]
    assert "--leaf-module CLASS naming a module that holds Gate" in lines[0]
    ok = runner.invoke(
        main, ["profile", f"{tmp_path / 'gated.py'}:make", "--leaf-module", "Gate", "--repeats", "1"]
    )
    assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize("args", [["--help"], ["profile", "--help"]])
def test_help_does_not_import_torch(args: list[str]) -> None:
    code = (
        "import sys, time; t = time.perf_counter(); from cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NOTORCH', time.perf_counter() - t)"
    )
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    assert out.stdout.split()[-2] == "NOTORCH"
    assert wall < 5.0  # ~0.3 s on an idle 2-core machine; loose for a busy CI host


def test_bfloat16_profile_halves_parameter_bytes(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(
        main, ["profile", "tiny-mlp", "--dtype", "bfloat16", "-o", "b.json", "--repeats", "1"]
    )
    assert result.exit_code == 0, result.output
    profile = load_profile(tmp_path / "b.json")
    assert profile.dtype == "bfloat16" and profile.total_param_bytes == 2 * 1930


def test_device_model_estimates_and_partition_plans_with_its_memory(
    runner: CliRunner, tmp_path: Path
) -> None:
    result = runner.invoke(
        main, ["profile", "tiny-gpt", "--batch-size", "2", "--device-model", "h100", "-o", "e.json"]
    )
    assert result.exit_code == 0, result.output
    profile = load_profile(tmp_path / "e.json")
    assert (
        profile.device == "h100" and profile.extra["estimate"]["device_model"]["memory_bytes"] == 80 * 2**30
    )
    planned = runner.invoke(main, ["partition", "--profile", "e.json", "--gpus", "2", "--json"])
    assert planned.exit_code == 0, planned.output
    assert json.loads(planned.stdout)["cluster"]["memory_bytes"] == 80 * 2**30  # the estimated device's
    assert "the memory of the h100" in planned.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device-model", "h10"], "unknown device model 'h10' (did you mean h100?)"),
        (["--device-model", "h100", "--repeats", "2"], "--repeats shapes a measurement"),
        (["--device-model", "h100", "--clock", "cpu"], "--clock shapes a measurement"),
        (
            ["--materialize", "layer", "--device", "cpu", "--leaf-module", "Nope"],
            "--leaf-module Nope matches",
        ),
    ],
)
def test_bad_estimate_options_are_one_line(runner: CliRunner, args: list[str], message: str) -> None:
    result = runner.invoke(main, ["profile", "tiny-gpt", "--batch-size", "2", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().startswith("error:") and message in result.stderr
    assert len([line for line in result.stderr.strip().splitlines() if not re.match(PROGRESS, line)]) == 1


def test_a_profile_made_layer_by_layer_partitions_and_verifies(runner: CliRunner, tmp_path: Path) -> None:
    """The graph traced without weights is the one `partition` re-traces to write the stages."""
    args = [
        "profile",
        "hf:llama",
        "--batch-size",
        "4",
        "--input-shape",
        "8",
        "--device",
        "cpu",
        "--repeats",
        "1",
    ]
    result = runner.invoke(main, [*args, "--materialize", "layer", "--no-fixed-cost"])
    assert result.exit_code == 0, result.output
    assert load_profile(tmp_path / "profiles" / "hf-llama" / "profile.json").extra["materialized"] == "layer"
    cuts = "model_layers_1_self_attn_q_proj_weight"
    planned = runner.invoke(
        main, ["partition", "--gpus", "2", "--schedule", "1f1b", "--cuts", cuts, "--replicas", "1,1"]
    )
    assert planned.exit_code == 0, planned.output
    verified = runner.invoke(main, ["verify"])
    assert verified.exit_code == 0, verified.output
    assert "match" in verified.output
