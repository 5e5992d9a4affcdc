"""A 3D package checked as it runs: on real ranks over gloo, each 3D stage split over its tensor ranks
and sharded over its copies by the runtime's own code, against the plain stage in one process.

The one-process check (:mod:`partitioner.verification.verify`) holds each stage's code to the
original model, but a stage's code is the same whatever its layout (docs/layout-3d.md): what tensor
parallelism and sharding add (the weights split into DTensor shards, Megatron's all-reduces around
the split linears, FSDP2's gathers and reduce-scatters) runs only on ranks. So here:

1. the plain stages run in one process on each copy's part of the minibatch and write what each
   3D stage reads and is held to (:mod:`partitioner.verification.rank_cases`);
2. the package's ranks start as ``pipeplan run`` starts them (the elastic launcher, gloo, one
   process per rank of ``stage_to_rank_map``: :func:`runtime.job.launch.call_ranks`), and each builds
   only its own stage, runs it once forward and backward and compares it, gathered whole
   (:mod:`partitioner.verification.rank_check`);
3. each stage's row is the worst of its ranks'.

Stages of plain replicas in a 3D package are the one-process check's alone (their ranks only take
part in creating the groups). A rank that fails ends the check with one line naming it and its
error; every rank's output is in ``<package>/verify/logs/``.

Example:
    >>> report = verify_on_ranks(Path("models/llama/gpus=4"))  # doctest: +SKIP
    >>> [s.ok for s in report.stages]
    [True, True]
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from partitioner.errors import PackageError
from partitioner.plan import Plan
from partitioner.verification.rank_cases import write_cases
from partitioner.verification.rank_check import RankCheck, RankTask, check_rank
from partitioner.verification.verify import ATOL, RTOL, load_package
from runtime.errors import JobFailed
from runtime.packages.job_config import JobConfig, load_job
from runtime.settings.run_options import RunOptions

__all__ = ["RanksReport", "StageOnRanks", "is_3d", "verify_on_ranks"]


@dataclass(frozen=True)
class StageOnRanks:
    """How one 3D stage, run on its ranks, compares with the plain stage (the worst of its ranks).

    Attributes:
        index: stage position.
        layout: its layout as a plan names it (``TP2``, ``DP2 fsdp``, ``TP2 x DP2 zero2``).
        ranks: the ranks it ran on.
        params: parameter elements of the whole stage.
        init_error: max |gathered - built| over its weights.
        output_error: max |ranks - plain| over its outputs.
        input_grad_error: max |ranks - plain| over its inputs' gradients.
        grad_error: max |gathered - plain| over its weights' gradients.
        failed: the ranks whose own comparison failed.
        ok: every rank's comparison passed.
    """

    index: int
    layout: str
    ranks: tuple[int, ...]
    params: int
    init_error: float
    output_error: float
    input_grad_error: float
    grad_error: float
    failed: tuple[int, ...]
    ok: bool


@dataclass(frozen=True)
class RanksReport:
    """The outcome of :func:`verify_on_ranks`."""

    package: Path
    world_size: int
    batch_size: int
    stages: tuple[StageOnRanks, ...]
    rtol: float
    atol: float
    logs: Path
    ok: bool


def is_3d(plan: Plan) -> bool:
    """Whether some stage of ``plan`` is split over tensor ranks or shards its copies."""
    return any(s.tensor_parallel > 1 or s.shard != "none" for s in plan.stages)


def verify_on_ranks(
    folder: Path,
    seed: int = 0,
    batch_size: int | None = None,
    rtol: float = RTOL,
    atol: float = ATOL,
    timeout: float = 60.0,
    progress: Callable[[str, int, int], None] = lambda *_: None,
) -> RanksReport:
    """Check every 3D stage of the package on its ranks (see the module docstring), on one minibatch
    of ``batch_size`` (the plan's by default) split over each stage's copies.

    Raises:
        PackageError: not a 3D package, a minibatch smaller than a stage's copies, or a rank that
            failed (one line naming it and its log).
        RunError: a layout the runtime refuses (before any rank starts, as ``pipeplan run`` would).
    """
    package, plan, _ = load_package(folder)
    if not is_3d(plan):
        raise PackageError(
            f"{folder} has no 3D stage (every stage t = 1, shard none): nothing to run on ranks"
        )
    job = load_job(folder)
    batch = batch_size or plan.batch_size or 2
    copies = {k: job.layout(k).copies for k in range(job.stages) if job.layout(k).is_3d}
    few = [k for k, d in copies.items() if d > batch]
    if few:
        raise PackageError(
            f"batch {batch} cannot give each of stage {few[0]}'s {copies[few[0]]} copies a sample"
        )
    _check_degrees(package, job)
    work = Path(folder) / "verify"
    cases = work / "cases"
    shutil.rmtree(cases, ignore_errors=True)
    cases.mkdir(parents=True)
    try:
        progress(f"the plain stages at batch {batch}, for the ranks", 0, 2)
        criterion = package.criterion()
        with torch.device("meta"):
            entries = package.model(criterion)
        wiring = [(list(e[1]), list(e[2])) for e in entries[:-1]]
        inputs, targets = package.example_inputs(batch), package.example_targets(batch)
        write_cases(package, wiring, seed, criterion, inputs, targets, copies, cases)
        progress(f"the 3D stages on {job.world_size} gloo ranks", 1, 2)
        checks = _launch(job, cases, work / "logs", seed, rtol, atol, timeout)
    finally:
        shutil.rmtree(cases, ignore_errors=True)
    stages = tuple(_stage(k, job, [c for c in checks if c.stage == k]) for k in sorted(copies))
    return RanksReport(
        Path(folder), job.world_size, batch, stages, rtol, atol, work / "logs", all(s.ok for s in stages)
    )


def _check_degrees(package: ModuleType, job: JobConfig) -> None:
    """Every split stage's degrees, on the meta device, as the launcher checks them (one line)."""
    from runtime.executing.tensor_parallel import check_degrees
    from runtime.packages.load import read_wiring

    check_degrees(package, read_wiring(package, job.stages, job.module_stages), job)


def _launch(
    job: JobConfig, cases: Path, logs: Path, seed: int, rtol: float, atol: float, timeout: float
) -> list[RankCheck]:
    """Every rank's checks, from ranks started as ``pipeplan run`` starts them."""
    from runtime.job.launch import call_ranks

    options = RunOptions.of(str(job.package), backend="gloo", timeout=timeout, launcher_pid=os.getpid())
    task = RankTask(options, str(cases), seed, rtol, atol)
    try:
        results = call_ranks(options, check_rank, task, logs=logs)
    except JobFailed as exc:
        raise PackageError(f"verify on {job.world_size} gloo ranks: {exc}") from exc
    return [check for rank in sorted(results) for check in results[rank]]


_SHORT = {"none": "", "optimizer": " zero1", "gradients": " zero2", "full": " fsdp"}


def _stage(k: int, job: JobConfig, checks: list[RankCheck]) -> StageOnRanks:
    """A stage's row: the worst of its ranks' comparisons."""
    lay = job.layout(k)
    parts = [f"TP{lay.tensor_parallel}"] if lay.tensor_parallel > 1 else []
    if lay.copies > 1:  # (the shard levels as partition's layout names say them)
        parts.append(f"DP{lay.copies}" + _SHORT[lay.shard])
    return StageOnRanks(
        index=k,
        layout=" x ".join(parts),
        ranks=tuple(job.stage_ranks[k]),
        params=max((c.params for c in checks), default=0),
        init_error=max((c.init_error for c in checks), default=0.0),
        output_error=max((c.output_error for c in checks), default=0.0),
        input_grad_error=max((c.input_grad_error for c in checks), default=0.0),
        grad_error=max((c.grad_error for c in checks), default=0.0),
        failed=tuple(c.rank for c in checks if not c.ok),
        ok=bool(checks) and all(c.ok for c in checks),
    )
