"""Microbatch counts: does the cost model rank M = 1, 2, 4, 8, 16 as `pipeplan run` does, and is the
count ``--schedule auto`` would pick the one that runs fastest?

More microbatches shrink a synchronous pipeline's bubble, but every microbatch pays each layer's
fixed time per call again (launches, dispatch, messages). ``pipeplan profile`` fits that fixed time
from a second measurement at an eighth of the batch; the planner charges it once per microbatch
(``partitioner.graph.at_microbatches``). This benchmark runs the same two-stage 1f1b plan at each
count (cut where half the profiled compute is done) and compares, per model:

- measured time per minibatch (``pipeplan run``'s metrics) against the prediction with fixed times
  (what ``partition`` now predicts) and the prediction without them (the same profile, fixed
  times zeroed: each microbatch its share of the samples, the model before this change);
- Spearman's rank correlation of each prediction against the measurements over the counts;
- regret: the measured time at each model's predicted-best count over the measured-best time.

Everything goes through the real CLI in a temporary folder: ``pipeplan profile MODEL --threads 1
--clock cpu``, ``pipeplan partition --gpus 2 --schedule 1f1b --microbatches M --cuts C --replicas
1,1`` (the same cut at every count, so only the count changes), ``pipeplan run PKG --steps N``. 2
ranks: this machine has 2 cores.

Run:  .venv/bin/python benchmarks/bench_microbatches.py
(writes benchmarks/results/bench_microbatches.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_fidelity import Cli, Model, cut_layers, spearman
from benchmarks.reporting import machine, write_results

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = (Model("vgg16", 16, "3,32,32"), Model("hf:llama", 16, "32"), Model("tiny-gpt", 16, "32"))
COUNTS = (1, 2, 4, 8, 16)


def without_fixed(doc: dict[str, Any]) -> dict[str, Any]:
    """The profile document with every layer's fixed time per call zeroed: microbatches priced as
    their share of the samples."""
    nodes = [{**n, "forward_fixed_ms": 0.0, "backward_fixed_ms": 0.0} for n in doc["nodes"]]
    return {**doc, "nodes": nodes}


def regret(predicted: list[float], measured: list[float]) -> float:
    """Measured time at the predicted-best count over the measured-best time (1.0: the right pick)."""
    pick = min(range(len(predicted)), key=predicted.__getitem__)
    return measured[pick] / min(measured)


def bench_model(cli: Cli, model: Model, steps: int, repeats: int) -> dict[str, Any]:
    """Profile once, then plan and run each count; the per-count rows and the model's summary."""
    name = model.spec.replace(":", "-")
    path = Path("profiles") / name / "profile.json"
    started = time.perf_counter()
    cli("profile", model.spec, "--batch-size", str(model.batch_size), "--input-shape", model.input_shape,
        "--threads", "1", "--clock", "cpu", "--repeats", str(repeats), "-o", str(path))  # fmt: skip
    profile_s = time.perf_counter() - started
    doc = json.loads((cli.folder / path).read_text())
    flat = Path("profiles") / name / "proportional.json"
    (cli.folder / flat).write_text(json.dumps(without_fixed(doc)))
    rows: list[dict[str, Any]] = []
    cuts = ",".join(cut_layers(doc, (0.5,)))  # two stages, cut where half the profiled compute is done
    for m in COUNTS:
        common = [
            "--gpus",
            "2",
            "--schedule",
            "1f1b",
            "--microbatches",
            str(m),
            "--cuts",
            cuts,
            "--replicas",
            "1,1",
        ]
        load = cli("partition", "--profile", str(path), *common, "-o", f"plans/{name}-m{m}")
        cli("partition", "--profile", str(flat), *common, "-o", f"flat/{name}-m{m}")
        package = next((cli.folder / f"plans/{name}-m{m}").glob("*/gpus=2"))
        plan = json.loads((package / "plan.json").read_text())
        flat_plan = json.loads(
            next((cli.folder / f"flat/{name}-m{m}").glob("*/gpus=2/plan.json")).read_text()
        )
        proportional = flat_plan["predicted"]["time_per_minibatch_s"]
        cli(
            "run",
            str(package.relative_to(cli.folder)),
            "--steps",
            str(steps),
            "--timeout",
            "600",
            "--no-checkpoint",
        )
        metrics = json.loads((package / "run" / "metrics.json").read_text())
        rows.append({
            "microbatches": plan["microbatches"],
            "cuts": cuts,
            "predicted_s": plan["predicted"]["time_per_minibatch_s"],
            "predicted_without_fixed_s": proportional,
            "measured_s": metrics["time_per_minibatch_s"],
            "load_1min": load,
        })  # fmt: skip
        print(f"{model.spec:10s} M={m:2d} predicted {rows[-1]['predicted_s'] * 1e3:8.1f} ms, without "
              f"fixed {proportional * 1e3:8.1f} ms, measured {rows[-1]['measured_s'] * 1e3:8.1f} ms",
              flush=True)  # fmt: skip
    measured = [r["measured_s"] for r in rows]
    with_fixed, flat_pred = [r["predicted_s"] for r in rows], [r["predicted_without_fixed_s"] for r in rows]
    fixed_total = sum(n.get("forward_fixed_ms", 0) + n.get("backward_fixed_ms", 0) for n in doc["nodes"])
    return {
        "model": model.spec,
        "batch_size": model.batch_size,
        "input_shape": model.input_shape,
        "profile_wall_s": round(profile_s, 1),
        "fixed_ms_per_call_all_layers": fixed_total,
        "compute_ms_per_minibatch": sum(n["forward_ms"] + n["backward_ms"] for n in doc["nodes"]),
        "rows": rows,
        "spearman_with_fixed": spearman(with_fixed, measured),
        "spearman_without_fixed": spearman(flat_pred, measured),
        "regret_with_fixed": regret(with_fixed, measured),
        "regret_without_fixed": regret(flat_pred, measured),
        "best_measured_count": rows[measured.index(min(measured))]["microbatches"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="Minibatches per run (the first is excluded).")
    parser.add_argument("--repeats", type=int, default=3, help="Profile repeats per layer.")
    parser.add_argument("--models", default=",".join(m.spec for m in MODELS), help="Subset, comma-separated.")
    args = parser.parse_args()
    started, load_before = time.perf_counter(), os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        cli = Cli(Path(tmp).resolve())
        for model in (m for m in MODELS if m.spec in args.models.split(",")):
            results.append(bench_model(cli, model, args.steps, args.repeats))
    report(args, results, (load_before, os.getloadavg()), time.perf_counter() - started)


def report(args: argparse.Namespace, results: list[dict[str, Any]], load: Any, wall_s: float) -> None:
    """bench_microbatches.json and .md."""

    doc = {
        "benchmark": "bench_microbatches",
        "setup": {**vars(args), "ranks": 2, "schedule": "1f1b", "counts": list(COUNTS),
                  "profile": "--threads 1 --clock cpu (fixed times from a second pass at batch/8)"},
        "machine": machine(load),
        "wall_s": round(wall_s, 1),
        "models": results,
    }  # fmt: skip
    md = [
        "# Microbatch counts: predicted against measured (1f1b, 2 ranks, gloo, this CPU)",
        "",
        f"`python benchmarks/bench_microbatches.py --steps {args.steps} --repeats {args.repeats}`; "
        f"{wall_s / 60:.1f} min; load {load[0][0]:.1f} before, {load[1][0]:.1f} after.",
        "",
        "| model | M | predicted ms | predicted without fixed ms | measured ms | measured / predicted |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for row in r["rows"]:
            md.append(f"| {r['model']} | {row['microbatches']} | {row['predicted_s'] * 1e3:.1f} | "
                      f"{row['predicted_without_fixed_s'] * 1e3:.1f} | {row['measured_s'] * 1e3:.1f} | "
                      f"{row['measured_s'] / row['predicted_s']:.2f} |")  # fmt: skip
    md += ["", "| model | best measured M | Spearman with fixed | without | regret with fixed | without |",
           "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        md.append(f"| {r['model']} | {r['best_measured_count']} | {r['spearman_with_fixed']:.2f} | "
                  f"{r['spearman_without_fixed']:.2f} | {r['regret_with_fixed']:.2f} | "
                  f"{r['regret_without_fixed']:.2f} |")  # fmt: skip
    md += ["", "Regret: measured time at the model's predicted-best count over the measured-best time (1.00: "
           "it picks the fastest count)."]  # fmt: skip
    write_results(RESULTS, "bench_microbatches", doc, md)
    print("\n".join(md))


if __name__ == "__main__":
    main()
