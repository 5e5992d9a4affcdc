"""`pipeplan run`: trains a package, writes metrics.json, prints measured vs predicted; clear failures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli import main
from partitioner.calibration.link_latency import waited_messages
from tests.runtime.packages import write_package

torch.set_num_threads(1)


@pytest.mark.slow
def test_run_trains_and_writes_metrics_checkpoints_and_trace(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    trace = tmp_path / "trace.json"
    args = [str(pkg), "--steps", "4", "--checkpoint-every", "2", "--trace", str(trace), "--timeout", "30",
            "--measure-memory"]  # fmt: skip
    result = CliRunner().invoke(main, ["run", *args])
    assert result.exit_code == 0, result.output
    metrics = json.loads((pkg / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 4 and metrics["predicted_time_per_minibatch_s"] == pytest.approx(0.01)
    assert metrics["time_per_minibatch_s"] > 0
    assert [s["stage"] for s in metrics["stages"]] == [0, 1]
    assert all(s["compute_s_per_minibatch"] > 0 for s in metrics["stages"])
    assert "time per minibatch" in result.output
    assert "peak memory per device" in result.output  # measured per stage, beside the prediction
    assert all(r["peak_memory_bytes"] > 0 for r in metrics["ranks"])
    assert sorted(p.name for p in (pkg / "run" / "checkpoints").iterdir()) == ["step-2", "step-4"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    assert any(e["name"] == "B3" for e in events)
    # what `calibrate --trace` reads: each receive is matched to its sender's span, on one clock
    messages = waited_messages(events, [(0.0, 0.0), (0.0, 0.0)])
    receives = sum(1 for e in events if e["name"].startswith("recv "))
    assert messages.seconds and len(messages.seconds) + messages.skipped == receives
    assert all(0 < t < 1 for t in messages.seconds)


def test_dry_run_prints_one_torchrun_line_per_node(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", replicas=(1, 1))
    args = ["run", str(pkg), "--dry-run", "--nnodes", "2", "--master-addr", "h0", "--master-port", "29500"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.strip().splitlines() if not line.startswith("#")]
    assert len(lines) == 2 and all(line.startswith("torchrun --nnodes 2") for line in lines)
    assert "# rank 1 (stage 1): 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1S0" in result.output  # one list per rank


def test_missing_package_exits_2_with_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["run", str(tmp_path / "nope"), "--steps", "1"])
    assert result.exit_code == 2
    assert "does not exist" in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args",
    [
        ["--weight-decay", "-1"],
        ["--betas", "0.9,1"],
        ["--betas", "0.9"],
        ["--lr-schedule", "step"],
        ["--optimizer", "rmsprop"],
        ["--clip-grad-norm", "nan"],
        ["--clip-grad-norm", "1", "--schedule", "pipedream"],
        ["--nesterov"],
        ["--warmup-steps", "-1"],
    ],
)
def test_bad_optimizer_settings_exit_2_with_one_line(tmp_path: Path, args: list[str]) -> None:
    pkg = write_package(tmp_path / "pkg", replicas=(1, 1))
    result = CliRunner().invoke(main, ["run", str(pkg), "--steps", "2", "--dry-run", *args])
    assert result.exit_code == 2
    assert result.output.startswith("error:") and len(result.output.strip().splitlines()) == 1


def test_optimizer_settings_reach_every_rank_and_a_long_warmup_gets_a_note(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", replicas=(1, 1))
    args = ["--optimizer", "adamw", "--betas", "0.8,0.99", "--lr-schedule", "cosine", "--warmup-steps", "5"]
    result = CliRunner().invoke(
        main, ["run", str(pkg), "--steps", "2", "--dry-run", "--clip-grad-norm", "1", *args]
    )
    assert result.exit_code == 0, result.output
    assert "note: --warmup-steps 5 is not below --steps 2" in result.output
    assert "--betas 0.8,0.99 --lr-schedule cosine --warmup-steps 5 --clip-grad-norm 1.0" in result.output


@pytest.mark.slow
def test_failing_rank_exits_1_naming_the_rank(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", replicas=(1, 1))
    source = (pkg / "stage1.py").read_text()
    (pkg / "stage1.py").write_text(source.replace("return self.fc(x)", "raise KeyError('no such layer')"))
    result = CliRunner().invoke(main, ["run", str(pkg), "--steps", "2", "--timeout", "20"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith(
        "error: training failed: rank 1 (stage 1) failed: KeyError: 'no such layer'; log: "
    )
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_like_torchrun(tmp_path: Path) -> None:
    import subprocess
    import sys

    from runtime.job.launch import free_port

    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1, 1, 1), microbatches=2, batch_size=4)
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cli",
                "run",
                str(pkg),
                "--steps",
                "3",
                "--nnodes",
                "2",
                "--node-rank",
                str(r),
                "--master-port",
                port,
                "--timeout",
                "30",
                "--checkpoint-dir",
                str(tmp_path / "ckpt"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for r in range(2)
    ]
    outputs = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "time per minibatch" in outputs[0]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step-3").iterdir()) == [
        ".metadata",  # every rank of both nodes wrote its own file of one DCP checkpoint
        *(f"__{r}_0.distcp" for r in range(4)),
        "meta.json",
    ]
    logs = pkg / "run" / "logs"  # the nodes share the folder: each keeps its own logs
    assert all((logs / f"node{r}" / "launcher.log").exists() for r in (0, 1))


@pytest.mark.slow
def test_text_data_trains_a_gpt_with_held_out_evaluation(tmp_path: Path) -> None:
    """A generated tiny-gpt (vocabulary 97) learns a text of characters below 97 byte by byte; the
    held-out loss and next-token accuracy reach the progress line and metrics.json."""
    from tests.runtime.generated import generate

    pkg = generate(tmp_path / "gpt", "tiny-gpt", (1, 1), "pipedream", batch_size=4, input_shape=(8,))
    (tmp_path / "train.txt").write_text("ABCDEFGHIJ0123456789\n" * 40)
    (tmp_path / "held.txt").write_text("ABCDEFGHIJ0123456789\n" * 4)
    args = ["--data", f"text:{tmp_path / 'train.txt'}", "--seq-len", "8", "--shuffle", "--optimizer", "adam"]
    args += ["--eval-data", f"text:{tmp_path / 'held.txt'}", "--eval-every", "10", "--lr", "0.01"]
    result = CliRunner().invoke(main, ["run", str(pkg), "--steps", "25", "--timeout", "30", *args])
    assert result.exit_code == 0, result.output
    metrics = json.loads((pkg / "run" / "metrics.json").read_text())
    evals = metrics["eval"]
    assert [e["step"] for e in evals] == [10, 20, 25]
    assert evals[0]["samples"] == 8  # 84 bytes: 10 windows of 8, 2 full minibatches
    assert evals[-1]["loss"] < evals[0]["loss"] and evals[-1]["accuracy"] > evals[0]["accuracy"]
    assert metrics["losses"][-1] < metrics["losses"][0]
    assert "held-out: step 10 eval" in result.output


@pytest.mark.slow
def test_an_image_folder_trains_a_cnn(tmp_path: Path) -> None:
    """Images of two sizes and modes, resized to the package's 3x16x16, classes from folder names."""
    from PIL import Image

    from tests.runtime.generated import generate

    pkg = generate(tmp_path / "cnn", "tiny-cnn", (1, 1), batch_size=4)
    for k, (name, colour) in enumerate([("blue", (0, 0, 255)), ("red", (255, 0, 0))]):
        (tmp_path / "images" / name).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (20 + 3 * i, 12), colour).save(tmp_path / "images" / name / f"{i}.png")
        Image.new("L", (9, 9), 60 + 120 * k).save(tmp_path / "images" / name / "grey.png")
    spec = f"imagefolder:{tmp_path / 'images'}"
    args = ["--data", spec, "--eval-data", spec, "--shuffle", "--lr", "0.05", "--data-workers", "2"]
    result = CliRunner().invoke(main, ["run", str(pkg), "--epochs", "3", "--timeout", "30", *args])
    assert result.exit_code == 0, result.output
    metrics = json.loads((pkg / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 3 * (10 // 4)
    (final,) = metrics["eval"]
    assert final["step"] == 6 and final["samples"] == 8 and 0 <= final["accuracy"] <= 1


@pytest.mark.slow
def test_a_default_run_saves_its_last_step_for_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's workflow without a checkpoint option: run saves the last step, export reads it;
    --no-checkpoint saves none and refuses the checkpoint options it would contradict. Each run keeps
    its own folder: export and calibrate read the newest, or the one --run-dir names."""
    monkeypatch.chdir(tmp_path)
    for args in (
        ["profile", "tiny-mlp"],
        ["partition", "--gpus", "2"],
        ["run", "--steps", "3", "--timeout", "30"],
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    package = Path("models/tiny-mlp/gpus=2")
    (first,) = (package / "runs").iterdir()
    assert [p.name for p in (first / "checkpoints").iterdir()] == ["step-3"]
    assert f"checkpoints: {first / 'checkpoints'}" in result.output
    result = CliRunner().invoke(main, ["export", "-o", "m.safetensors"])
    assert result.exit_code == 0 and (tmp_path / "m.safetensors").is_file(), result.output
    result = CliRunner().invoke(main, ["run", "--steps", "4", "--no-checkpoint", "--timeout", "30"])
    assert result.exit_code == 0 and [p.name for p in (first / "checkpoints").iterdir()] == ["step-3"]
    (second,) = set((package / "runs").iterdir()) - {first}
    assert json.loads((first / "metrics.json").read_text())["steps"] == 3  # the first run's, kept
    assert json.loads((package / "run" / "metrics.json").read_text())["steps"] == 4  # run/: the newest
    assert (package / "run").resolve() == second.resolve()
    result = CliRunner().invoke(main, ["export", "-o", "n.safetensors"])  # the newest run saved none
    assert result.exit_code == 2 and str(second / "checkpoints") in result.output, result.output
    result = CliRunner().invoke(main, ["export", "-o", "n.safetensors", "--run-dir", str(first)])
    assert result.exit_code == 0 and (tmp_path / "n.safetensors").is_file(), result.output
    for run_dir in ([], ["--run-dir", str(first)]):
        result = CliRunner().invoke(
            main, ["calibrate", str(package), *run_dir, "-o", "c.json", "--accept-load"]
        )
        assert result.exit_code == 0, result.output
        source = json.loads((tmp_path / "c.json").read_text())["extra"]["calibrated"]["runs"][0]["metrics"]
        assert Path(source).resolve().parent == (first if run_dir else second).resolve()
    result = CliRunner().invoke(main, ["run", "--no-checkpoint", "--resume"])
    assert result.exit_code == 2 and "--no-checkpoint contradicts --resume" in result.output
