"""What ``pipeplan run`` is about to do, said before the ranks start.

Why: starting torch on every rank takes seconds; the user should know in the meantime which package,
how many ranks on which hosts, under which schedule, for how many steps, and where its metrics, logs
and checkpoints will be, rather than wait in silence and learn it only at the end.
"""

from __future__ import annotations

from pathlib import Path

from runtime.packages.job_config import JobConfig
from runtime.settings.run_options import RunOptions

__all__ = ["run_header"]


def run_header(
    options: RunOptions, job: JobConfig, per_node: int, steps: int | None
) -> list[tuple[str, str]]:
    """(label, text) rows: package, ranks and hosts, schedule, steps and data, and the files the run
    writes. ``options`` is resolved (its run folder and resume step filled in)."""
    from runtime.job.worker import resolve_backend  # (imports torch, as launching does anyway)

    world, backend = job.world_size, resolve_backend(options.backend)
    device = "GPU" if backend == "nccl" else "CPU"
    stages = len(job.stage_ranks)
    replicas = [len(ranks) for ranks in job.stage_ranks]
    model = f"{job.model}, " if job.model else ""
    rows = [("package", f"{options.package} ({model}{_plural(stages, 'stage')})")]
    layout = "one per stage" if world == stages else "replicas per stage " + " ".join(map(str, replicas))
    if job.virtual_stages > 1:
        layout = f"{job.virtual_stages} stages each"
    if options.nnodes == 1:
        where = f"on this machine ({device}s, {backend})"
    else:
        where = (
            f"on {options.nnodes} nodes, {per_node} here (node {options.node_rank}); rendezvous "
            f"{options.master_addr}:{options.master_port} ({device}s, {backend})"
        )
    rows.append(("ranks", f"{_plural(world, 'rank')} {where}; {layout}"))
    micro = job.microbatches
    size = job.batch_size // micro if micro else job.batch_size
    rows.append((
        "schedule",
        f"{job.schedule}, {_plural(micro, 'microbatch', 'microbatches')} of {_plural(size, 'sample')} "
        f"(minibatch {job.batch_size}), {job.precision}",
    ))  # fmt: skip
    rows.append(("steps", _steps(options, steps)))
    run = Path(options.run_dir or Path(options.package) / "run")
    rows.append(("writes", f"{run}/ (metrics.json, logs/, steps/)"))
    rows.append(("checkpoints", _checkpoints(options)))
    if options.trace:
        rows.append(("trace", options.trace))
    return rows


def _steps(options: RunOptions, steps: int | None) -> str:
    data = "synthetic data" if options.data == "synthetic" else options.data
    count = _plural(steps, "step") if steps is not None else _plural(options.epochs or 1, "epoch")
    resumed = f", continuing after step {options.resume_step}" if options.resume_step else ""
    return f"{count} on {data}{resumed}"


def _checkpoints(options: RunOptions) -> str:
    if not options.checkpoint_dir:
        return "none (--no-checkpoint)"
    every = f"every {_plural(options.checkpoint_every, 'step')} and " if options.checkpoint_every else ""
    return f"{options.checkpoint_dir}/ ({every}the last step)"


def _plural(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else many or one + 's'}"
