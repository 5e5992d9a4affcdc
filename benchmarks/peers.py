"""torch.distributed.pipelining's ranks set up, fed and timed exactly as pipeplan's own, and the
pairing of the two runtimes' runs round by round: what makes a runtime benchmark's comparison like
for like.

Same process settings: a CPU rank of ``pipeplan run`` keeps freed heap (``keep_freed_memory``, a
glibc ``mallopt``) and splits the cores among the ranks (``share_cores``); a torch rank here calls
the very same two functions. Without the first, each of torch's steps pays thousands of minor page
faults that pipeplan's do not, which is the allocator's difference, not the runtimes'.

Same work: the stages the package lays on each rank (its mp_conf.json, as pipeplan reads it), the
same synthetic minibatches (:class:`runtime.datasets.minibatches.SyntheticBatches`, same seed), the same
optimizer (SGD, lr 0.01, ``zero_grad(set_to_none=True)``) and the same gradient arithmetic: pipeplan scales
each microbatch's loss by its share of the minibatch (1/M) before the backward; torch's schedules
by default divide the accumulated gradients by M after the last backward (``scale_grads=True``),
the same gradients by one more pass over them. The torch rank here scales the loss as pipeplan does
and passes ``scale_grads=False``.

Same start: the ranks start as ``pipeplan run`` starts its own (its launcher's start method, a fork
server by default), under the same elastic launch.

Same timing window: a step runs from the end of the previous step to the end of its optimizer step
(data included), as pipeplan's step clock counts it; per step the slower rank's time; the median
over the steps after the same warm-up steps (:func:`step_window`, applied to both).

Paired rounds: each round runs every pair back to back, and the next round in the reverse order
(:func:`round_order`), so a burst of load from other jobs hits both sides of a pair alike; the
headline is the median of the per-round ratios (:func:`paired`, :func:`median_ratio`), never a ratio
of medians taken over different rounds.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from runtime.datasets.minibatches import SyntheticBatches
from runtime.job.launch import free_port, launch
from runtime.job.worker import keep_freed_memory, share_cores
from runtime.packages.job_config import load_job
from runtime.packages.load import import_package
from runtime.settings.run_options import RunOptions

TORCH_SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "zb1p": "ScheduleInterleavedZeroBubble",
    "interleaved": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
}
"""pipeplan's schedule -> torch.distributed.pipelining's counterpart (zb1p: torch's zero bubble
schedule with one stage per rank, its ZB-H1 form)."""

ALIKE = (
    "Both runtimes' ranks set up, fed and timed alike (benchmarks/peers.py): glibc keeps freed heap, "
    "the cores split among the ranks, the same synthetic minibatches, each microbatch's loss scaled by "
    "1/M before its backward, SGD (lr 0.01), a step timed from the previous step's end to the end of its "
    "optimizer step, the slower rank's. Each pair runs back to back, the order reversed every other "
    "round; a ratio is torch's time over pipeplan's in one round (above 1: pipeplan faster), the "
    "headline their median."
)
"""The sentence every runtime benchmark's report carries: what its comparison holds equal."""


def set_up_like_pipeplan() -> None:
    """What pipeplan's worker does to a CPU rank's process before training (``runtime.job.worker``)."""
    keep_freed_memory()
    share_cores()


def step_window(per_rank: Sequence[Sequence[float]], warmup: int) -> list[float]:
    """Per step, the slower rank's seconds, the first ``warmup`` steps dropped."""
    return [max(ts) for ts in zip(*per_rank, strict=True)][warmup:]


def round_order(pairs: Sequence[tuple[str, str]], r: int) -> list[str]:
    """The runs of round ``r``: each pair back to back, in reverse order every other round (which
    side of a pair goes first alternates, and so do the pairs' places in the round)."""
    runs = [name for pair in pairs for name in pair]
    return runs if r % 2 == 0 else runs[::-1]


def paired(rounds: Sequence[dict[str, Any]], ours: str, theirs: str) -> list[float]:
    """Per round, ``theirs``' seconds per minibatch over ``ours`` (run back to back in that round);
    rounds where either failed are skipped."""
    return [
        r[theirs]["s_per_minibatch"] / r[ours]["s_per_minibatch"]
        for r in rounds
        if "s_per_minibatch" in r.get(ours, {}) and "s_per_minibatch" in r.get(theirs, {})
    ]


def median_ratio(ratios: Sequence[float]) -> float | None:
    """The headline of a pair: the median of its per-round ratios (None when no round ran both)."""
    return statistics.median(ratios) if ratios else None


def pairs_markdown(
    pairs: Sequence[tuple[str, str]],
    per_round: dict[str, list[float]],
    medians: dict[str, float | None],
    loads: Sequence[float],
) -> list[str]:
    """A report's lines on its pairs: what they hold equal (:data:`ALIKE`), then per pair the
    per-round ratios and their median (``per_round`` and ``medians`` keyed by pipeplan's run), and
    the machine's 1-minute load as each round began."""

    def short(name: str) -> str:
        return name.removeprefix("pipeplan ").removeprefix("torch ")

    return [
        ALIKE,
        "",
        "| pipeplan | torch | torch / pipeplan per round | median |",
        "|---|---|---|---|",
        *(
            f"| {short(ours)} | {short(theirs)} | {', '.join(f'{x:.2f}' for x in per_round[ours]) or '-'} | "
            f"**{'-' if medians[ours] is None else format(medians[ours], '.2f')}** |"
            for ours, theirs in pairs
        ),
        "",
        "1-minute load as each round began: " + ", ".join(f"{x:.2f}" for x in loads) + ".",
    ]


def torch_rank(package: str, schedule: str, steps: int, microbatches: int, seed: int = 0) -> dict[str, Any]:
    """One rank of torch.distributed.pipelining's counterpart of ``schedule`` on the stages the
    package lays on this rank, for ``steps`` minibatches of ``microbatches``: each step's seconds
    and, as pipeplan's metrics report it, the sum of squares of the rank's parameters at the end
    (the module docstring says what is the same as pipeplan's rank). Run under torch's elastic
    launch."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, schedules

    set_up_like_pipeplan()
    torch.manual_seed(seed)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    job, pkg = load_job(package), import_package(package)
    total, m = len(job.stage_ranks), microbatches
    ids = [k for k, ranks in enumerate(job.stage_ranks) if rank in ranks]
    modules = [pkg.stage(k) for k in ids]
    stages = [PipelineStage(mod, k, total, torch.device("cpu")) for mod, k in zip(modules, ids, strict=True)]
    criterion = pkg.criterion()
    kind = getattr(schedules, TORCH_SCHEDULES[schedule])
    placed: Any = stages[0] if issubclass(kind, schedules.PipelineScheduleSingle) else stages
    runner = kind(placed, m, loss_fn=lambda out, y: criterion(out, y) / m, scale_grads=False)
    optimizer = torch.optim.SGD([p for mod in modules for p in mod.parameters()], lr=0.01)
    data = SyntheticBatches(pkg, [spec["name"] for spec in job.inputs], job.batch_size, seed)
    times, last = [], time.perf_counter()
    for step in range(steps):
        args = data.inputs(step) if 0 in ids else ()
        kwargs = {"target": data.targets(step), "losses": []} if total - 1 in ids else {}
        runner.step(*args, **kwargs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    dist.barrier()
    dist.destroy_process_group()
    squares = sum(p.detach().double().square().sum() for mod in modules for p in mod.parameters())
    return {"step_times_s": times, "param_sq_sum": float(squares)}


def elastic(fn: Callable[..., Any], *args: Any, start_method: str = "fork") -> dict[int, Any]:
    """Run ``fn(*args)`` on 2 local ranks with torch's elastic launch; each rank's result."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"rank": 0},
        max_restarts=0,
        monitor_interval=0.1,
        start_method=start_method,
    )
    return elastic_launch(config, fn)(*args)  # type: ignore[no-any-return]


def run_torch(package: Path, schedule: str, steps: int, micro: int, warmup: int) -> dict[str, Any]:
    """torch's counterpart of ``schedule`` on the package's 2 ranks: the median step (slower rank,
    after ``warmup`` steps), the steps themselves and each rank's parameters' sum of squares."""
    started = RunOptions(str(package)).start_method  # how ``pipeplan run`` starts its ranks
    per_rank = elastic(torch_rank, str(package), schedule, steps, micro, start_method=started)
    ranks = [per_rank[k] for k in sorted(per_rank)]
    steps_s = step_window([r["step_times_s"] for r in ranks], warmup)
    return {
        "s_per_minibatch": statistics.median(steps_s),
        "steps_s": steps_s,
        "param_sq_sum": [r["param_sq_sum"] for r in ranks],
    }


def run_pipeplan(
    package: Path, schedule: str, steps: int, micro: int, warmup: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One ``pipeplan run``-like job: the median step as :func:`run_torch` takes it, the median
    measured bubble (1 - both ranks' compute over 2 x the step) and the ranks' compute CPU per
    minibatch; and the run's metrics.json document."""
    metrics = launch(
        RunOptions(str(package), steps=steps, microbatches=micro, schedule=schedule, backend="gloo")
    )
    assert metrics is not None
    ranks = metrics["ranks"]
    walls = step_window([r["step_times_s"] for r in ranks], warmup)
    busy = [sum(cs) for cs in zip(*(r["step_compute_s"] for r in ranks), strict=True)][warmup:]
    bubbles = [1.0 - c / (len(ranks) * w) for c, w in zip(busy, walls, strict=True)]
    cpu = sum(r.get("compute_cpu_s", 0.0) for r in ranks) / len(ranks[0]["step_times_s"])
    return {
        "s_per_minibatch": statistics.median(walls),
        "steps_s": walls,
        "bubble": statistics.median(bubbles),
        "compute_cpu_s_per_minibatch": cpu,
    }, metrics
