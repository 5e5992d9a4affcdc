"""pipeplan's zbv (ZB-V: 2 stages per rank laid out as a V, backward split into B and W) against
torch.distributed.pipelining's ScheduleZBVZeroBubble on the same 4-stage split and microbatches, on
2 gloo ranks of this CPU; with pipeplan's zb1p and 1f1b on the 2-stage split of the same layers for
reference.

The model is bench_interleaved's MLP (Linear+ReLU layers of one width, a 10-class head), cut into 4
stages of equal layers for zbv (rank 0: stages 0 and 3, rank 1: stages 1 and 2) and into 2 for zb1p
and 1f1b. Measured bubble, per step: 1 - (compute seconds of both ranks) / (2 x the step's wall
time, the slower rank's), median over the steps after warm-up (pipeplan's runs only: torch's
schedules report no compute time). Predicted bubble: what the planner predicts, the event simulation
of the runtime's own lists (``partitioner.optimizer.pricing.simulate.play`` on
``runtime.schedule``'s zbv lists; zb1p and 1f1b: the closed forms of
``partitioner.optimizer.pricing.schedules``), fed with each stage's forward and backward per
microbatch timed in
this process after each round (median over rounds), one thread, no communication, the backward
split into B and W by ``W_SHARE`` as the planner does. Runs alternate and repeat: this machine is
shared.

Run:  .venv/bin/python -m benchmarks.bench_zbv
      (writes benchmarks/results/bench_zbv.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_interleaved import _INIT, Bench, arguments, paired, play_rounds, report
from benchmarks.bench_runtime import _elastic
from benchmarks.bench_runtime import write_package as write_two_stages
from benchmarks.bench_schedules import run_ours
from partitioner.optimizer.pricing.schedules import zero_bubble_time
from partitioner.optimizer.pricing.simulate import play
from partitioner.optimizer.pricing.stage import W_SHARE
from runtime.package import import_package
from runtime.schedule import build, layout_of

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = 2
OURS, THEIRS = "pipeplan zbv", "torch ScheduleZBVZeroBubble"
RUNS = (OURS, THEIRS, "pipeplan zb1p", "pipeplan 1f1b")
BENCH = Bench(
    "bench_zbv",
    OURS,
    THEIRS,
    RUNS,
    "zero bubble V (2 stages per rank as a V)",
    "zbv: 4 stages (rank 0: stages 0 and 3, rank 1: 1 and 2); zb1p and 1f1b: the same layers in 2 stages.",
)


def write_zbv(folder: Path, width: int, layers: int, batch: int, micro: int) -> Path:
    """The 4-stage package laid out as ``pipeplan partition --schedule zbv`` lays it: a V."""
    stages = 2 * RANKS
    homes = [r for (r,) in layout_of("zbv", RANKS, 2)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text(_INIT.format(width=width, layers=layers, stages=stages))
    conf = {
        "module_to_stage_map": [*range(stages), stages - 1],
        "stage_to_rank_map": {str(k): [homes[k]] for k in range(stages)},
    }
    (folder / "mp_conf.json").write_text(json.dumps(conf))
    plan = {
        "schema": "pipeplan.plan/1",
        "gpus": RANKS,
        "cluster": {"levels": [{"devices": RANKS, "bandwidth": 1e9}]},
        "schedule": "zbv",
        "virtual_stages": 2,
        "microbatches": micro,
        "batch_size": batch,
        "stages": [{"index": k, "nodes": [], "replicas": 1, "ranks": [homes[k]]} for k in range(stages)],
        "predicted": {"time_per_minibatch_s": 0.0},
        "solver": {"name": "written by hand (no prediction)"},
        "extra": {"inputs": [{"name": "x", "shape": [batch, width], "dtype": "float32"}]},
    }
    (folder / "plan.json").write_text(json.dumps(plan, indent=1))
    return folder


def _torch_rank(package: str, steps: int, micro: int, batch: int) -> list[float]:
    """One rank of torch.distributed.pipelining's ScheduleZBVZeroBubble on its two stages of the V
    (rank 0 feeds the inputs and, holding the last stage, the targets too)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    pkg = import_package(package)
    ids = (rank, 2 * RANKS - 1 - rank)  # the V: down, then back up
    modules = [pkg.stage(k) for k in ids]
    stages: list[Any] = [
        PipelineStage(mod, k, 2 * RANKS, torch.device("cpu")) for mod, k in zip(modules, ids, strict=True)
    ]
    loss_fn = pkg.criterion()
    schedule = ScheduleZBVZeroBubble(stages, micro, loss_fn=lambda out, y: loss_fn(out, y))
    optim = torch.optim.SGD([p for mod in modules for p in mod.parameters()], lr=0.01)
    times = []
    for step in range(steps):
        torch.manual_seed(step)
        x, y = pkg.example_inputs(batch)["x"], pkg.example_targets(batch)
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x, target=y, losses=[])
        else:
            schedule.step()
        optim.step()
        optim.zero_grad()
        times.append(time.perf_counter() - start)
    dist.barrier()
    dist.destroy_process_group()
    return times


def run_theirs(package: Path, steps: int, micro: int, batch: int, warmup: int) -> dict[str, float]:
    per_rank = _elastic(_torch_rank, str(package), steps, micro, batch)
    walls = [max(a, b) for a, b in zip(per_rank[0], per_rank[1], strict=True)][warmup:]
    return {"s_per_minibatch": statistics.median(walls)}


def _one(name: str, four: Path, two: Path, args: argparse.Namespace) -> dict[str, Any]:
    m = args.microbatches
    if name == OURS:
        return run_ours(four, "zbv", args.steps, m, args.warmup)
    if name == THEIRS:
        return run_theirs(four, args.steps, m, args.batch_size, args.warmup)
    return run_ours(two, name.split()[-1], args.steps, m, args.warmup)


def predicted(f: list[float], b: list[float], m: int) -> dict[str, float]:
    """Predicted bubble (share of the span the ranks idle) of each pipeplan run from the 4 stages'
    forward and backward per microbatch: zbv by the simulation of its lists (the planner's price),
    zb1p and 1f1b on the 2-stage split by their closed forms."""
    work = sum(m * (fk + bk) for fk, bk in zip(f, b, strict=True))
    split_b, split_w = [t * (1 - W_SHARE) for t in b], [t * W_SHARE for t in b]
    v = layout_of("zbv", RANKS, 2)
    events, _ = play(build("zbv", v, m), v, f, split_b, [0.0] * len(f), split_w)
    zbv = max(e.end_s for e in events)
    halves = [slice(k * 2, (k + 1) * 2) for k in range(RANKS)]
    f2, b2 = [sum(f[h]) for h in halves], [sum(b[h]) for h in halves]
    zb1p = zero_bubble_time(f2, b2, [0.0] * RANKS, m)
    one = sum(x + y for x, y in zip(f2, b2, strict=True)) + (m - 1) * max(
        x + y for x, y in zip(f2, b2, strict=True)
    )
    return {
        OURS: 1.0 - work / (RANKS * zbv),
        "pipeplan zb1p": 1.0 - work / (RANKS * zb1p),
        "pipeplan 1f1b": 1.0 - work / (RANKS * one),
        "zbv_s": zbv,
        "zb1p_s": zb1p,
        "1f1b_s": one,
    }


def main() -> None:
    args = arguments(__doc__.splitlines()[0], steps=12)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        b, m = args.batch_size, args.microbatches
        four = write_zbv(Path(tmp) / "four", args.width, args.layers, b, m)
        two = write_two_stages(Path(tmp) / "two", args.width, args.layers, b, m)
        rounds, f, bw = play_rounds(args, four, two, RUNS, _one)
    report(BENCH, args, rounds, f, bw, predicted(f, bw, args.microbatches), (load_before, os.getloadavg()))


def _paired(rounds: list[dict[str, Any]]) -> list[float]:
    """Per round, torch's zbv time over pipeplan's (run back to back in that round)."""
    return paired(rounds, OURS, THEIRS)


if __name__ == "__main__":
    main()
