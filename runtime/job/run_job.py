"""``pipeplan run`` as one library call: the run's options -> checked, a run folder, the resume
resolved, the ranks launched -> what happened.

Why one call: the command line only parses and prints, as ``pipeplan partition`` does with
:func:`partitioner.partition.partition`, and a script or a test runs a job the way the command does
(the same checks, lock, run folder and notes) without the command line. What the user should hear
while the job runs (notes on the settings, what ``--resume`` found, the header before the ranks
start, each step's loss) goes to the callbacks of :class:`RunEvents` as it happens; the metrics come
back in :class:`RunOutcome`.

Example:
    >>> done = run_job(RunRequest(RunOptions("models/vgg16/gpus=2", steps=2)))  # doctest: +SKIP
    >>> done.metrics["time_per_minibatch_s"]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.datasets.minibatches import SYNTHETIC_STEPS
from runtime.job.launch import (
    Progress,
    check_launch,
    holding_run_folder,
    launch,
    resolve_resume,
    schedule_preview,
    torchrun_commands,
)
from runtime.job.run_checks import check_run
from runtime.job.run_folders import begin, discard_if_empty
from runtime.job.run_header import run_header
from runtime.job.worker import job_of
from runtime.observing.metrics import cpu_share
from runtime.settings.run_options import RunOptions

__all__ = ["RunEvents", "RunOutcome", "RunRequest", "RunStart", "run_job"]


def _quiet(_: Any) -> None:
    return None


@dataclass(frozen=True)
class RunRequest:
    """What ``pipeplan run`` was asked: the options (the package folder resolved), whether the run
    keeps checkpoints (``--no-checkpoint`` turns them off), and ``--dry-run`` (the torchrun commands
    and one minibatch of each rank's actions, nothing started or written)."""

    options: RunOptions
    checkpoints: bool = True
    dry_run: bool = False


@dataclass(frozen=True)
class RunStart:
    """Said once the checks passed and before the ranks start (they take seconds to): the header's
    (label, text) rows (:func:`runtime.job.run_header.run_header`), the steps the progress counts to (None:
    not known before the data is read) and the package's folder name."""

    header: tuple[tuple[str, str], ...]
    total: int | None
    package: str


@dataclass(frozen=True)
class RunEvents:
    """Where the job's news goes as it happens: ``note``, a remark on the settings that is no error;
    ``resume``, what ``--resume`` found (the step, skipped or torn checkpoints, accepted changes);
    ``start``, the header; ``progress``, each step's loss and evaluations (from the loss-reporting
    rank, on a thread of the launcher)."""

    note: Callable[[str], None] = _quiet
    resume: Callable[[str], None] = _quiet
    start: Callable[[RunStart], None] = _quiet
    progress: Progress | None = None


@dataclass(frozen=True)
class RunOutcome:
    """What a run did. ``options`` are the run's as resolved (its run and checkpoint folders, the
    resume step); ``metrics`` is rank 0's metrics.json as written to ``metrics_path`` (None for a dry
    run and on nodes other than 0); ``cpu_share`` the share of a core the CPU ranks had while
    computing (None on GPUs); a dry run has the torchrun ``commands`` and the ``preview``."""

    options: RunOptions
    metrics: dict[str, Any] | None = None
    metrics_path: Path | None = None
    cpu_share: float | None = None
    commands: tuple[str, ...] = ()
    preview: tuple[str, ...] = ()


def run_job(request: RunRequest, events: RunEvents = RunEvents()) -> RunOutcome:
    """Check the settings, then (holding the package's run lock from the first check to the end) make
    the run's folder, check the launch, resolve ``--resume`` and train; a run refused before any rank
    wrote a file leaves no folder behind.

    Raises:
        RunError: settings, package, data or resume that no run could start with.
        JobFailed: a rank raised or died.
        Interrupted: the launcher got a signal (Ctrl-C, SIGTERM).
    """
    options = request.options
    for line in check_run(options):
        events.note(line)
    if request.dry_run:
        return _dry_run(begin(options, request.checkpoints, create=False))
    with holding_run_folder(options):
        options = begin(options, request.checkpoints)
        try:
            return _train(options, events)
        finally:
            discard_if_empty(options)


def _dry_run(options: RunOptions) -> RunOutcome:
    """The torchrun line of every node and each rank's actions, after the same launch checks."""
    commands = tuple(torchrun_commands(options))
    return RunOutcome(options, commands=commands, preview=tuple(schedule_preview(options)))


def _train(options: RunOptions, events: RunEvents) -> RunOutcome:
    """Launch checks, the resume, the header, the job; ``options`` hold their run folder."""
    per_node = check_launch(options)
    options, notes = resolve_resume(options)
    for line in notes:
        events.resume(line)
    total = options.steps or (
        (options.epochs or 1) * SYNTHETIC_STEPS if options.data == "synthetic" else None
    )
    header = run_header(options, job_of(options), per_node, total)
    events.start(RunStart(tuple(header), total, Path(options.package).name))
    metrics = launch(options, events.progress, per_node)
    if metrics is None:
        return RunOutcome(options)
    path = Path(options.run_dir or Path(options.package) / "run") / "metrics.json"
    return RunOutcome(options, metrics, path, cpu_share(metrics))
