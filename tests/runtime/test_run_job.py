"""``pipeplan run`` as one library call: what :func:`runtime.job.run_job.run_job` tells its callbacks, in
order, and what it returns, for a run of two steps, a dry run and a refused run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.errors import RunError
from runtime.job.run_job import RunEvents, RunRequest, RunStart, run_job
from runtime.settings.run_options import RunOptions
from tests.runtime.packages import write_package


def _recording(said: list[tuple[str, Any]]) -> RunEvents:
    def progress(step: int, loss: float, evaluation: dict[str, Any] | None = None) -> None:
        said.append(("progress", step))

    return RunEvents(
        note=lambda line: said.append(("note", line)),
        resume=lambda line: said.append(("resume", line)),
        start=lambda start: said.append(("start", start)),
        progress=progress,
    )


@pytest.mark.slow
def test_a_two_step_run_says_its_notes_header_and_steps_then_returns_its_metrics(tmp_path: Path) -> None:
    package = write_package(tmp_path / "chain", replicas=(1, 1))
    options = RunOptions.of(
        str(package), steps=2, warmup_steps=2, backend="gloo", timeout=30, start_method="forkserver"
    )
    said: list[tuple[str, Any]] = []
    done = run_job(RunRequest(options), _recording(said))

    kinds = [kind for kind, _ in said]
    assert kinds == ["note", "start", "progress", "progress"], said
    assert "--warmup-steps 2 is not below --steps 2" in said[0][1]
    start = said[1][1]
    assert isinstance(start, RunStart) and start.total == 2 and start.package == "chain"
    assert [label for label, _ in start.header][:4] == ["package", "ranks", "schedule", "steps"]
    assert [step for _, step in said[2:]] == [1, 2]

    run = Path(done.options.run_dir or "")
    assert run.parent == package / "runs" and (package / "run").resolve() == run.resolve()
    assert done.metrics is not None and len(done.metrics["losses"]) == 2
    assert done.metrics_path == run / "metrics.json" and done.metrics_path.is_file()
    assert done.options.checkpoint_dir == str(run / "checkpoints")
    assert (run / "checkpoints" / "step-2").is_dir()
    assert done.cpu_share is None or 0 < done.cpu_share <= 1
    assert done.commands == done.preview == ()


def test_a_dry_run_returns_the_commands_and_writes_nothing(tmp_path: Path) -> None:
    package = write_package(tmp_path / "chain", replicas=(1, 1))
    done = run_job(RunRequest(RunOptions(str(package), steps=2), dry_run=True))
    assert len(done.commands) == 1 and done.commands[0].startswith("torchrun --nnodes 1 ")
    assert [line.split(":")[0] for line in done.preview] == ["rank 0 (stage 0)", "rank 1 (stage 1)"]
    assert done.metrics is None
    assert not [p for p in (package / "runs").rglob("*") if p.is_file()]  # (preflight's folders aside)


def test_a_refused_run_raises_and_leaves_no_run_folder(tmp_path: Path) -> None:
    package = write_package(tmp_path / "chain", replicas=(1, 1))
    said: list[tuple[str, Any]] = []
    with pytest.raises(RunError, match="3 nodes cannot share evenly"):
        run_job(RunRequest(RunOptions(str(package), nnodes=3, master_port=29500)), _recording(said))
    assert said == [] and not any((package / "runs").glob("*"))
