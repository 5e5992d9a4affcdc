"""`pipeplan run --resume` is exact or says what changed, in one line before any rank starts;
`--config` repeats a run; step lines appear while the run goes on."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli import main
from runtime.checkpoints.read_tensors import read_stage
from runtime.checkpoints.step_folders import steps_in
from tests.runtime.packages import write_package

pytestmark = pytest.mark.slow
COSINE = ["--optimizer", "adam", "--lr-schedule", "cosine", "--warmup-steps", "1", "--timeout", "30"]


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["run", *args])
    return result.exit_code, result.output


def test_a_resume_that_would_change_the_run_is_refused_or_accepted_by_name(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    code, out = _run(str(pkg), "--steps", "4", "--checkpoint-every", "2", *COSINE)
    assert code == 0, out
    metrics = (pkg / "run" / "metrics.json").read_text()

    code, out = _run(str(pkg), "--steps", "2", "--resume", *COSINE)
    assert code == 2 and out.count("\n") == 1, out
    assert (
        out.startswith("error: ")
        and "is at step 4 and this run ends at step 2: nothing is left to train" in out
    )
    assert (pkg / "run" / "metrics.json").read_text() == metrics  # nothing ran, nothing overwritten

    for changed, words in [
        (
            ["--steps", "8"],
            "the learning rate's horizon 4 -> 8 steps (the cosine decay ends at the last step",
        ),
        (["--steps", "6", "--seed", "1"], "--seed 0 -> 1"),
        (["--steps", "6", "--microbatches", "4"], "--microbatches 2 -> 4"),
    ]:
        code, out = _run(str(pkg), "--resume", *COSINE, *changed)
        assert code == 2 and out.startswith("error: resuming would change the run: ") and words in out, out
    code, out = _run(str(pkg), "--steps", "6", "--resume", *COSINE, "--optimizer", "sgd")
    assert code == 2 and "holds adam's optimizer state, which sgd cannot continue" in out, out

    code, out = _run(str(pkg), "--steps", "8", "--resume", "--accept-changes", *COSINE)
    assert code == 0, out
    assert "resuming with a change: the learning rate's horizon 4 -> 8 steps" in out
    assert "resuming after step 4" in out and steps_in(pkg / "run" / "checkpoints") == [8, 4, 2]


def test_keep_checkpoints_keeps_the_newest_and_the_pinned(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    code, out = _run(
        str(pkg),
        "--steps",
        "6",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "2",
        "--pin-every",
        "4",
        "--checkpoint-async",
        "--timeout",
        "30",
    )
    assert code == 0, out
    assert steps_in(pkg / "run" / "checkpoints") == [6, 5, 4]


def test_config_file_repeats_a_run_and_flags_win(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    (tmp_path / "run.toml").write_text(
        f'package = "{pkg}"\nsteps = 3\nlr = 0.2\nbetas = [0.8, 0.9]\noptimizer = "adam"\n'
        "checkpoint-every = 3\n"
    )
    code, out = _run("--config", str(tmp_path / "run.toml"), "--steps", "2", "--timeout", "30")
    assert code == 0, out
    written = (pkg / "run" / "run.toml").read_text()
    assert "steps = 2\n" in written and "lr = 0.2\n" in written and "betas = [0.8, 0.9]\n" in written
    first = read_stage(pkg / "run" / "checkpoints", 2, 0)
    code, out = _run("--config", str(pkg / "run" / "run.toml"), "--checkpoint-dir", str(tmp_path / "again"))
    assert code == 0, out
    again = read_stage(tmp_path / "again", 2, 0)
    assert all(torch.equal(first[n], again[n]) for n in first)
    (tmp_path / "bad.toml").write_text("stepz = 3\n")
    code, out = _run("--config", str(tmp_path / "bad.toml"))
    assert code == 2 and "unknown key 'stepz'" in out and out.count("\n") == 1, out
    (tmp_path / "bad.toml").write_text("steps = 0\n")
    code, out = _run(str(pkg), "--config", str(tmp_path / "bad.toml"))
    assert code == 2 and "steps" in out, out


def test_step_lines_appear_while_the_run_goes_on(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    log = pkg / "run" / "steps" / "rank1.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "run", str(pkg), "--steps", "100000", "--timeout", "30"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        seen = []
        deadline = time.monotonic() + 120
        while len(seen) < 3 and time.monotonic() < deadline and proc.poll() is None:
            lines = log.read_text().splitlines() if log.exists() else []
            if lines and (not seen or len(lines) > seen[-1]):
                seen.append(len(lines))
            time.sleep(0.05)
        assert len(seen) == 3, seen  # the file grew three times while the run went on
        assert [json.loads(line)["step"] for line in log.read_text().splitlines()[:3]] == [1, 2, 3]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
