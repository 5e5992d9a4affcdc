"""Memory fidelity and the cost of recomputation: each stage's predicted peak memory (plan.json) against
the peak `pipeplan run` measures, with and without activation recomputation, per schedule.

Everything goes through the real CLI in a temporary folder: ``pipeplan profile MODEL --threads 1
--clock cpu --microbatch-size B/M``, then for every schedule one fixed 2-stage plan (cut where half the
profiled compute is done, ``--cuts/--replicas 1,1``: the same stages with and without recomputation)
``pipeplan partition --recompute none|all``, and ``pipeplan run PKG --steps N``.

Measured memory is metrics.json's ``memory`` (``runtime/observing/peak_memory.py``): on this CPU, the stage's
parameters, buffers, gradients and optimizer state at the start plus the highest running sum of the
bytes of the tensor storages its operators made and torch had not yet freed, over the first
``ranks + 1`` minibatches;
no non-tensor memory. Predicted is plan.json's ``memory_bytes`` (``cost.price_stage``).

Recomputation's cost: per (model, schedule), the time per minibatch with it over without (measured:
median step of the slower rank, first step excluded, and the ranks' compute CPU seconds, which other
jobs on this shared CPU disturb less; predicted: plan.json) and its peak memory over without's.

Targets (issue 13): measured within 25% of predicted per stage. The 1-minute load average is recorded
before every command.

The prediction is ``partitioner/optimizer/pricing/memory.py``'s model: weights, gradients and optimizer state
(tied copies included), pipedream's weight snapshots, the gradient a replica accumulates, and the
activations of the items in flight. An earlier run of this benchmark found the middle three missing
(21 of 48 stages within 25%); they are priced now.

Run:  .venv/bin/python benchmarks/bench_memory.py   (writes benchmarks/results/memory.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_fidelity import Cli, cut_layers
from benchmarks.reporting import machine, write_results

RESULTS = Path(__file__).resolve().parent / "results"
SCHEDULES = (("1f1b", 4), ("gpipe", 4), ("pipedream", 1))


@dataclass(frozen=True)
class Model:
    """One model of the benchmark: its spec and the profile's shape."""

    spec: str
    batch_size: int
    input_shape: str

    @property
    def label(self) -> str:
        """The spec and input shape: one model may be measured at two shapes."""
        return f"{self.spec}@{self.input_shape.replace(',', 'x')}"


# vgg16 and gpt2 hold mostly weights at these sizes; resnet18 at 128x128 mostly activations
MODELS = (
    Model("vgg16", 8, "3,32,32"),
    Model("resnet18", 8, "3,64,64"),
    Model("gpt2", 4, "32"),
    Model("resnet18", 8, "3,128,128"),
)


def profile(cli: Cli, model: Model, micro: int) -> Path:
    """``pipeplan profile`` at ``micro`` samples (one thread, the CPU clock, one timed repeat)."""
    path = Path("profiles") / f"{model.label}-micro{micro}" / "profile.json"
    cli("profile", model.spec, "--batch-size", str(model.batch_size), "--input-shape", model.input_shape,
        "--threads", "1", "--clock", "cpu", "--repeats", "1", "--microbatch-size", str(micro),
        "-o", str(path))  # fmt: skip
    return path


def plan_and_run(
    cli: Cli, model: Model, path: Path, schedule: str, m: int, recompute: str, index: int, steps: int
) -> dict[str, Any]:
    """The fixed 2-stage plan under ``schedule`` and ``recompute``, run; plan.json against metrics.json."""
    cut = cut_layers(json.loads((cli.folder / path).read_text()), (0.5,))
    out = f"plans/{index:02d}"
    cli("partition", "--profile", str(path), "--gpus", "2", "--schedule", schedule, "--microbatches", str(m),
        "--cuts", cut[0], "--replicas", "1,1", "--recompute", recompute, "-o", out)  # fmt: skip
    package = next((cli.folder / out).glob("*/gpus=2"))
    load = cli(
        "run",
        str(package.relative_to(cli.folder)),
        "--steps",
        str(steps),
        "--timeout",
        "300",
        "--no-checkpoint",
        "--measure-memory",
    )
    plan = json.loads((package / "plan.json").read_text())
    metrics = json.loads((package / "run" / "metrics.json").read_text())
    ranks = metrics["ranks"]
    return {
        "model": model.label,
        "schedule": schedule,
        "microbatches": m,
        "recompute": recompute,
        "cut": cut[0],
        "stages": [
            {
                "stage": s["stage"],
                "recompute": plan["stages"][s["stage"]]["recompute"],
                "predicted_bytes": s["predicted_bytes"],
                "measured_bytes": s["measured_peak_bytes"],
                "measured_over_predicted": s["ratio_measured_over_predicted"],
            }
            for s in metrics["memory"]["stages"]
        ],
        "memory_method": metrics["memory"]["method"],
        "memory_window_minibatches": metrics["memory"]["window_minibatches"],
        "predicted_s": plan["predicted"]["time_per_minibatch_s"],
        "measured_s": metrics["time_per_minibatch_s"],
        "compute_cpu_s_per_minibatch": sum(
            r["compute_cpu_s"] / max(1, len(r["step_times_s"])) for r in ranks
        ),
        "load_1min": load,
    }


def recompute_cost(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, schedule): recomputation's time and peak memory over keeping activations."""
    out = []
    for keep in (r for r in runs if r["recompute"] == "none"):
        again = next(
            (r for r in runs if r["recompute"] == "all" and (r["model"], r["schedule"]) == (keep["model"],
             keep["schedule"])), None,
        )  # fmt: skip
        if again is None:
            continue
        out.append({
            "model": keep["model"],
            "schedule": keep["schedule"],
            "time_measured": again["measured_s"] / keep["measured_s"],
            "time_compute_cpu": again["compute_cpu_s_per_minibatch"] / keep["compute_cpu_s_per_minibatch"],
            "time_predicted": again["predicted_s"] / keep["predicted_s"],
            "memory_measured": [a["measured_bytes"] / k["measured_bytes"]
                                for a, k in zip(again["stages"], keep["stages"], strict=True)],
            "memory_predicted": [a["predicted_bytes"] / k["predicted_bytes"]
                                 for a, k in zip(again["stages"], keep["stages"], strict=True)],
        })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="Minibatches per run (the first is excluded).")
    labels = ",".join(m.label for m in MODELS)
    parser.add_argument("--models", default=labels, help="Model labels (spec@shape), comma-separated.")
    parser.add_argument("--schedules", default=",".join(s for s, _ in SCHEDULES), help="Subset.")
    parser.add_argument("--keep", default=None, help="Work in this folder (kept) instead of a temporary one.")
    args = parser.parse_args()
    chosen = [m for m in MODELS if m.label in args.models.split(",")]
    schedules = [(s, m) for s, m in SCHEDULES if s in args.schedules.split(",")]
    started, load_before = time.perf_counter(), os.getloadavg()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        cli = Cli(folder)
        for model in chosen:
            paths: dict[int, Path] = {}
            for schedule, m in schedules:
                micro = model.batch_size // m
                if micro not in paths:  # one profile per microbatch size
                    paths[micro] = profile(cli, model, micro)
                for recompute in ("none", "all"):
                    runs.append(plan_and_run(cli, model, paths[micro], schedule, m, recompute, len(runs),
                                             args.steps))  # fmt: skip
                    ratios = " ".join(f"{s['measured_over_predicted']:.2f}" for s in runs[-1]["stages"])
                    print(f"{model.label:18s} {schedule:9s} recompute {recompute:4s} "
                          f"measured/predicted {ratios}", flush=True)  # fmt: skip
    report(args, runs, (load_before, os.getloadavg()), time.perf_counter() - started)


def report(
    args: argparse.Namespace, runs: list[dict[str, Any]], load: tuple[tuple[float, ...], ...], wall_s: float
) -> None:
    """memory.json (every run's stages, predicted and measured) and memory.md."""

    ratios = [s["measured_over_predicted"] for r in runs for s in r["stages"]]
    within = sum(1 for x in ratios if 0.75 <= x <= 1.25)
    doc = {
        "benchmark": "bench_memory",
        "setup": {**vars(args), "ranks": 2, "backend": "gloo", "plan": "2 stages cut at 50% of the compute"},
        "machine": machine(load),
        "wall_s": round(wall_s, 1),
        "stages_within_25_percent": f"{within} of {len(ratios)}",
        "median_measured_over_predicted": statistics.median(ratios) if ratios else None,
        "runs": runs,
        "recompute_cost": recompute_cost(runs),
    }  # fmt: skip
    md = _markdown(doc)
    write_results(RESULTS, "memory", doc, md)
    print("\n".join(md))


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def _markdown(doc: dict[str, Any]) -> list[str]:
    load, machine = doc["machine"]["load_average_before_after"], doc["machine"]
    lines = [
        "# bench_memory: predicted (plan.json) against measured (`pipeplan run`) peak memory per stage",
        "",
        f"2 gloo ranks on a {machine['cpu_count']}-core CPU shared with other jobs (1-min load "
        f"{load[0][0]:.2f} before, {load[1][0]:.2f} after), torch {machine['torch']}; "
        f"`pipeplan run --steps {doc['setup']['steps']}`; whole benchmark {doc['wall_s']:.0f} s. "
        "Each model's 2-stage plan is cut where half its profiled compute is done, the same stages with "
        "and without `--recompute all`. Measured: the stage's tensors at the start plus the peak of "
        "bytes of live tensor storages operators made (CPU), over the first minibatches.",
        "",
        "Predicted: `partitioner/optimizer/pricing/memory.py` (weights, gradients and optimizer state "
        "with tied "
        "copies, pipedream's weight snapshots, the gradient a replica accumulates, activations in "
        "flight). Ratio: measured / predicted.",
        "",
        "| model | schedule | M | recompute | stage 0 MiB pred / meas | ratio "
        "| stage 1 MiB pred / meas | ratio | predicted s | measured s | load |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["runs"]:
        cells = [f"{_mib(s['predicted_bytes'])} / {_mib(s['measured_bytes'])} | "
                 f"{s['measured_over_predicted']:.2f}" for s in r["stages"]]  # fmt: skip
        lines.append(f"| {r['model']} | {r['schedule']} | {r['microbatches']} | {r['recompute']} | "
                     f"{' | '.join(cells)} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | "
                     f"{r['load_1min']:.2f} |")  # fmt: skip
    lines += [
        "",
        f"Stages within 25% of the prediction: **{doc['stages_within_25_percent']}**, median "
        f"measured/predicted {doc['median_measured_over_predicted']:.2f}.",
        "",
        "Recomputation's cost (with / without; time: measured wall, the ranks' compute CPU time, and "
        "predicted; peak memory per stage: measured and predicted):",
        "",
        "| model | schedule | time wall | time CPU | time predicted | memory measured | memory predicted |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in doc["recompute_cost"]:
        measured = " / ".join(f"{x:.2f}" for x in c["memory_measured"])
        predicted = " / ".join(f"{x:.2f}" for x in c["memory_predicted"])
        lines.append(f"| {c['model']} | {c['schedule']} | {c['time_measured']:.2f} "
                     f"| {c['time_compute_cpu']:.2f} | {c['time_predicted']:.2f} | {measured} "
                     f"| {predicted} |")  # fmt: skip
    return lines


if __name__ == "__main__":
    main()
