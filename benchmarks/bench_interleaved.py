"""pipeplan's interleaved 1F1B (2 virtual stages per rank) against torch.distributed.pipelining's
ScheduleInterleaved1F1B on the same 4-stage split and microbatches, on 2 gloo ranks of this CPU; with
pipeplan's and torch's plain 1F1B on the 2-stage split of the same layers for reference.

The model is bench_runtime's MLP (Linear+ReLU layers of one width, a 10-class head), cut into 4
stages of equal layers for interleaved (stage k on rank k mod 2) and into 2 for 1F1B. Measured
bubble, per step: 1 - (compute seconds of both ranks) / (2 x the step's wall time, the slower
rank's), median over the steps after warm-up (pipeplan's runs only: torch's schedules report no
compute time). Each pair (pipeplan's run and torch's counterpart) runs back to back in every round,
the order reversed every other round, both sides set up, fed and timed alike
(benchmarks/peers.py); a pair's headline is the median of its per-round ratios. Predicted bubble:
the planner's closed forms (partitioner/optimizer/pricing/schedules.py) fed with each stage's
forward and backward per microbatch timed in this process after each round (median over the
rounds), one thread, no communication: interleaved
:func:`partitioner.optimizer.pricing.schedules.interleaved_time`, 1F1B ``sum t_k + (M-1) max t_k``.
Rounds repeat: this machine is shared.

Run:  .venv/bin/python -m benchmarks.bench_interleaved
      (writes benchmarks/results/bench_interleaved.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_runtime import write_package as write_two_stages
from benchmarks.peers import median_ratio, paired, pairs_markdown, round_order, run_pipeplan, run_torch
from benchmarks.reporting import write_results
from partitioner.optimizer.pricing.schedules import interleaved_time
from runtime.packages.load import import_package

RESULTS = Path(__file__).resolve().parent / "results"
RANKS, VIRTUAL = 2, 2

_INIT = '''"""Benchmark package: an MLP of {layers} Linear+ReLU layers of width {width}, {stages} stages."""
import torch
from torch import nn

WIDTH, LAYERS, STAGES, CLASSES = {width}, {layers}, {stages}, 10


class Part(nn.Module):
    def __init__(self, first, last):
        super().__init__()
        pairs = [(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(first, last)]
        self.layers = nn.Sequential(*[m for pair in pairs for m in pair])
        self.head = nn.Linear(WIDTH, CLASSES) if last == LAYERS else None

    def forward(self, x):
        x = self.layers(x)
        return self.head(x) if self.head is not None else x


def full_model(seed=0):
    torch.manual_seed(seed)
    step = LAYERS // STAGES
    return nn.ModuleList([Part(k * step, (k + 1) * step) for k in range(STAGES)])


def stage(k, seed=0, device="cpu"):
    return full_model(seed)[k].to(device)


def arch():
    return "bench-mlp"


def model(criterion):
    parts = full_model()
    names = ["x"] + [f"h{{k}}" for k in range(STAGES - 1)] + ["logits"]
    stages = [(parts[k], [names[k]], [names[k + 1]]) for k in range(STAGES)]
    return stages + [(criterion, ["logits"], ["loss"])]


def criterion():
    return nn.CrossEntropyLoss()


def example_inputs(batch_size):
    return {{"x": torch.randn(batch_size, WIDTH)}}


def example_targets(batch_size):
    return torch.randint(0, CLASSES, (batch_size,))
'''


def write_interleaved(folder: Path, width: int, layers: int, batch: int, micro: int) -> Path:
    """The 4-stage package, stage k on rank k mod 2, as ``pipeplan partition --schedule interleaved``
    lays it out."""
    stages = RANKS * VIRTUAL
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text(_INIT.format(width=width, layers=layers, stages=stages))
    ranks = {str(k): [k % RANKS] for k in range(stages)}
    conf = {"module_to_stage_map": [*range(stages), stages - 1], "stage_to_rank_map": ranks}
    (folder / "mp_conf.json").write_text(json.dumps(conf))
    plan = {
        "schema": "pipeplan.plan/1",
        "gpus": RANKS,
        "cluster": {"levels": [{"devices": RANKS, "bandwidth": 1e9}]},
        "schedule": "interleaved",
        "virtual_stages": VIRTUAL,
        "microbatches": micro,
        "batch_size": batch,
        "stages": [{"index": k, "nodes": [], "replicas": 1, "ranks": [k % RANKS]} for k in range(stages)],
        "predicted": {"time_per_minibatch_s": 0.0},
        "solver": {"name": "written by hand (no prediction)"},
        "extra": {"inputs": [{"name": "x", "shape": [batch, width], "dtype": "float32"}]},
    }
    (folder / "plan.json").write_text(json.dumps(plan, indent=1))
    return folder


def stage_times(package: Path, batch: int, m: int, repeats: int = 30) -> tuple[list[float], list[float]]:
    """Median forward and backward seconds per microbatch of every stage, one thread, in this process
    (the first 5 of ``repeats`` dropped: allocation)."""
    torch.set_num_threads(1)
    pkg, micro = import_package(package), batch // m
    parts = pkg.full_model(0)
    x, y, loss_fn = pkg.example_inputs(micro)["x"], pkg.example_targets(micro), pkg.criterion()
    fwd, bwd = [], []
    for k, part in enumerate(parts):
        f, b = [], []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(k > 0)
            start = time.perf_counter()
            out = part(inp)
            root = loss_fn(out, y) if k == len(parts) - 1 else out
            f.append(time.perf_counter() - start)
            start = time.perf_counter()
            root.backward(None if k == len(parts) - 1 else torch.ones_like(out))
            b.append(time.perf_counter() - start)
        fwd.append(statistics.median(f[5:]))
        bwd.append(statistics.median(b[5:]))
        x = out.detach()
    return fwd, bwd


@dataclass(frozen=True)
class Bench:
    """What tells bench_interleaved's and bench_zbv's reports apart: the file name, the pairs
    compared (pipeplan's run, torch's counterpart; the first is the headline), the runs without a
    counterpart, the title and the line saying how the stages lie."""

    name: str
    pairs: tuple[tuple[str, str], ...]
    alone: tuple[str, ...]
    title: str
    layout: str

    @property
    def runs(self) -> tuple[str, ...]:
        return (*(name for pair in self.pairs for name in pair), *self.alone)


OneRun = Callable[[str, Path, Path, argparse.Namespace], dict[str, Any]]
"""One named run of a round: its package folders and the options -> its measurements."""

RUNS = ("pipeplan interleaved", "torch ScheduleInterleaved1F1B", "pipeplan 1f1b", "torch Schedule1F1B")
BENCH = Bench(
    "bench_interleaved",
    ((RUNS[0], RUNS[1]), (RUNS[2], RUNS[3])),
    (),
    f"interleaved 1F1B ({VIRTUAL} virtual stages per rank)",
    "Interleaved: 4 stages (stage k on rank k mod 2); 1F1B: the same layers in 2 stages.",
)


def _one(name: str, four: Path, two: Path, args: argparse.Namespace) -> dict[str, Any]:
    m = args.microbatches
    if name == "pipeplan interleaved":
        return run_pipeplan(four, "interleaved", args.steps, m, args.warmup)[0]
    if name == "pipeplan 1f1b":
        return run_pipeplan(two, "1f1b", args.steps, m, args.warmup)[0]
    if "Interleaved" in name:
        return run_torch(four, "interleaved", args.steps, m, args.warmup)
    return run_torch(two, "1f1b", args.steps, m, args.warmup)


def arguments(description: str, steps: int) -> argparse.Namespace:
    """The options bench_interleaved and bench_zbv share: the MLP, its batch and the rounds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def play_rounds(
    args: argparse.Namespace, four: Path, two: Path, bench: Bench, one: OneRun
) -> tuple[list[dict[str, Any]], list[float], list[float]]:
    """``args.repeats`` rounds of every run, each pair back to back and the order reversed every other
    round (the machine's load drifts), each round also timing the four stages alone; the rounds and
    the stages' median forward and backward."""
    rounds: list[dict[str, Any]] = []
    b, m = args.batch_size, args.microbatches
    for r in range(args.repeats):
        got: dict[str, Any] = {"load_1min": os.getloadavg()[0]}
        order = round_order(bench.pairs, r)
        for name in order + list(bench.alone) if r % 2 == 0 else list(bench.alone) + order:
            try:
                got[name] = one(name, four, two, args)
            except Exception as exc:  # a schedule that cannot run this split: say why
                got[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        got["stage_times"] = stage_times(four, b, m)
        rounds.append(got)
    stages = len(rounds[0]["stage_times"][0])
    f = [statistics.median(r["stage_times"][0][k] for r in rounds) for k in range(stages)]
    bw = [statistics.median(r["stage_times"][1][k] for r in rounds) for k in range(stages)]
    return rounds, f, bw


def main() -> None:
    args = arguments(__doc__.splitlines()[0], steps=8)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        b, m = args.batch_size, args.microbatches
        four = write_interleaved(Path(tmp) / "four", args.width, args.layers, b, m)
        two = write_two_stages(Path(tmp) / "two", args.width, args.layers, b, m)
        rounds, f, bw = play_rounds(args, four, two, BENCH, _one)
    report(BENCH, args, rounds, f, bw, predicted(f, bw, args.microbatches), (load_before, os.getloadavg()))


def predicted(f: list[float], b: list[float], m: int) -> dict[str, float]:
    """Closed-form bubble (share of the span the ranks idle) of each schedule from the stage times."""
    work = sum(m * (fk + bk) for fk, bk in zip(f, b, strict=True))
    inter = interleaved_time(f, b, [0.0] * len(f), m, RANKS)
    halves = [slice(k * VIRTUAL, (k + 1) * VIRTUAL) for k in range(RANKS)]  # the 2-stage split's stages
    two = [sum(f[h]) + sum(b[h]) for h in halves]
    one = sum(two) + (m - 1) * max(two)
    return {
        "pipeplan interleaved": 1.0 - work / (RANKS * inter),
        "pipeplan 1f1b": 1.0 - work / (RANKS * one),
        "interleaved_s": inter,
        "1f1b_s": one,
    }


def _median(rounds: list[dict[str, Any]], name: str, key: str) -> float | None:
    values = [r[name][key] for r in rounds if key in r.get(name, {})]
    return statistics.median(values) if values else None


def report(
    bench: Bench,
    args: argparse.Namespace,
    rounds: list[dict[str, Any]],
    f: list[float],
    b: list[float],
    pred: dict[str, float],
    load: tuple[Any, Any],
) -> None:
    """``benchmarks/results/<bench.name>.{json,md}``: medians per run, measured against predicted bubble,
    the throughput ratio of the pair and its rounds."""
    rows: dict[str, dict[str, Any]] = {
        name: {
            "s_per_minibatch": _median(rounds, name, "s_per_minibatch"),
            "measured_bubble": _median(rounds, name, "bubble"),
            "predicted_bubble": pred.get(name),
            "errors": sorted({r[name]["error"] for r in rounds if "error" in r.get(name, {})}),
        }
        for name in bench.runs
    }
    pairs = {ours: paired(rounds, ours, theirs) for ours, theirs in bench.pairs}
    doc = {
        "config": vars(args),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "load_1min_before_after": [load[0][0], load[1][0]],
        "stage_forward_s_per_microbatch": f,
        "stage_backward_s_per_microbatch": b,
        "predicted": pred,
        "results": rows,
        "torch_over_pipeplan_per_round": pairs,
        "torch_over_pipeplan_median": {name: median_ratio(ratios) for name, ratios in pairs.items()},
        "rounds": rounds,
    }
    write_results(RESULTS, bench.name, doc, _markdown(bench, doc))
    print(_markdown(bench, doc))


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _markdown(bench: Bench, doc: dict[str, Any]) -> str:
    cfg, load = doc["config"], doc["load_1min_before_after"]
    lines = [
        f"# {bench.name}: {bench.title} on 2 gloo ranks on CPU",
        "",
        f"MLP {cfg['layers']} x {cfg['width']}, batch {cfg['batch_size']}, {cfg['microbatches']} "
        f"microbatches, {cfg['steps']} steps ({cfg['warmup']} warm-up dropped), {cfg['repeats']} "
        f"alternating rounds; load (1 min) {load[0]:.1f} before, {load[1]:.1f} after on "
        f"{doc['host']['cpus']} CPUs. {bench.layout}",
        "",
        "| run | s / minibatch | measured bubble | predicted bubble |",
        "|---|---|---|---|",
    ]
    for name, row in doc["results"].items():
        note = f" (failed: {row['errors'][0]})" if row["errors"] and row["s_per_minibatch"] is None else ""
        lines.append(
            f"| {name}{note} | {_fmt(row['s_per_minibatch'], '.4f')} | {_fmt(row['measured_bubble'], '.2f')} "
            f"| {_fmt(row['predicted_bubble'], '.2f')} |"
        )
    f, b = doc["stage_forward_s_per_microbatch"], doc["stage_backward_s_per_microbatch"]
    loads = [r["load_1min"] for r in doc["rounds"]]
    lines += [
        "",
        *pairs_markdown(
            bench.pairs, doc["torch_over_pipeplan_per_round"], doc["torch_over_pipeplan_median"], loads
        ),
        "",
        "Stage times per microbatch (one thread, alone): forward "
        + " / ".join(f"{t * 1e3:.1f}" for t in f)
        + " ms, backward "
        + " / ".join(f"{t * 1e3:.1f}" for t in b)
        + " ms.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
