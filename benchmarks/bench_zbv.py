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
split into B and W by ``W_SHARE`` as the planner does. pipeplan's zbv and torch's run back to back
in every round, the order reversed every other round, both sides set up, fed and timed alike
(benchmarks/peers.py); the headline is the median of the per-round ratios (not a ratio of medians
over different rounds). Rounds repeat: this machine is shared.

Run:  .venv/bin/python -m benchmarks.bench_zbv
      (writes benchmarks/results/bench_zbv.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_interleaved import _INIT, Bench, arguments, play_rounds, report
from benchmarks.bench_runtime import write_package as write_two_stages
from benchmarks.peers import paired, run_pipeplan, run_torch
from partitioner.optimizer.pricing.schedules import zero_bubble_time
from partitioner.optimizer.pricing.simulate import play
from partitioner.optimizer.pricing.stage import W_SHARE
from runtime.schedule import build, layout_of

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = 2
OURS, THEIRS = "pipeplan zbv", "torch ScheduleZBVZeroBubble"
RUNS = (OURS, THEIRS, "pipeplan zb1p", "pipeplan 1f1b")
BENCH = Bench(
    "bench_zbv",
    ((OURS, THEIRS),),
    RUNS[2:],
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


def _one(name: str, four: Path, two: Path, args: argparse.Namespace) -> dict[str, Any]:
    m = args.microbatches
    if name == OURS:
        return run_pipeplan(four, "zbv", args.steps, m, args.warmup)[0]
    if name == THEIRS:
        return run_torch(four, "zbv", args.steps, m, args.warmup)
    return run_pipeplan(two, name.split()[-1], args.steps, m, args.warmup)[0]


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
        rounds, f, bw = play_rounds(args, four, two, BENCH, _one)
    report(BENCH, args, rounds, f, bw, predicted(f, bw, args.microbatches), (load_before, os.getloadavg()))


def _paired(rounds: list[dict[str, Any]]) -> list[float]:
    """Per round, torch's zbv time over pipeplan's (run back to back in that round)."""
    return paired(rounds, OURS, THEIRS)


if __name__ == "__main__":
    main()
