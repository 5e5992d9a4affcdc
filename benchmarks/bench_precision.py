"""Mixed precision: what bf16 and fp16 cost against fp32 in time and memory, through the real CLI.

For every model and precision P, in a temporary folder, as a user would run it:

1. ``pipeplan profile MODEL --precision P --threads 1 --clock cpu --microbatch-size B/2``: layer times,
   the bytes kept for backward (activations, and autocast's low-precision weight copies apart) and
   the bytes crossing stages, as a rank of a 2-microbatch pipeline computes them;
2. ``pipeplan partition --profile ... --gpus 2 --schedule 1f1b --microbatches 2``: the optimizer's
   2-stage cut of the fp32 profile (``--straight``), and the same cut (``--cuts X --replicas 1,1``)
   for bf16 and fp16, so the three runs train the same stages;
3. ``pipeplan run PKG --steps N``: the plan's precision; measured time per minibatch (median step of
   the slower rank, first excluded), the ranks' compute CPU time per minibatch (forward, backward
   and optimizer, both stages: the work, steadier than wall time when other jobs take the cores),
   each rank's peak memory (``metrics.json``'s ``peak_memory_bytes``: on a CPU the tensors that
   ``runtime/observing/peak_memory.py`` counts; results written before it were the whole process's resident
   size) and the losses.

The runs of one model are repeated ``--rounds`` times, the precisions in alternating order, and the
median round is reported, since other jobs share this CPU (its 1-minute load average is recorded
before every command). fp16 is timed with fewer steps: this CPU has bf16 instructions
(``avx512_bf16``) but none for fp16, whose matrix products fall back to slow kernels.

Run:  .venv/bin/python benchmarks/bench_precision.py   (writes benchmarks/results/precision.{json,md})
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

from benchmarks.bench_fidelity import Cli
from benchmarks.reporting import machine, write_results

RESULTS = Path(__file__).resolve().parent / "results"
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Model:
    """One model of the benchmark: its spec and the profile's shape."""

    spec: str
    batch_size: int
    input_shape: str


MODELS = (Model("resnet18", 8, "3,64,64"), Model("hf:llama", 8, "128"))


def profile(cli: Cli, model: Model, precision: str, repeats: int) -> tuple[Path, dict[str, Any]]:
    """``pipeplan profile`` at ``precision``; the path and what it measured."""
    name = model.spec.replace(":", "-")
    path = Path("profiles") / f"{name}-{precision}" / "profile.json"
    micro = model.batch_size // 2
    started = time.perf_counter()
    load = cli(
        "profile", model.spec, "--batch-size", str(model.batch_size), "--input-shape", model.input_shape,
        "--threads", "1", "--clock", "cpu", "--repeats", str(repeats), "--microbatch-size", str(micro),
        "--precision", precision, "-o", str(path),
    )  # fmt: skip
    doc = json.loads((cli.folder / path).read_text())
    nodes = doc["nodes"]
    return path, {
        "model": model.spec,
        "precision": precision,
        "batch_size": model.batch_size,
        "measured_at": micro,
        "input_shape": model.input_shape,
        "compute_ms": sum(n["forward_ms"] + n["backward_ms"] for n in nodes),
        "step_ms": doc["step_ms"],
        "saved_bytes": sum(n["saved_bytes"] for n in nodes),
        "cast_bytes": sum(n.get("cast_bytes", 0) for n in nodes),
        "param_bytes": sum(n["param_bytes"] for n in nodes),
        "output_bytes": {n["id"]: n["output_bytes"] for n in nodes},
        "profile_wall_s": round(time.perf_counter() - started, 1),
        "load_1min": load,
    }


def partition(cli: Cli, path: Path, out: str, cut: str | None) -> dict[str, Any]:
    """A straight 2-stage 1f1b plan (the optimizer's, or at ``cut``); plan.json and the package."""
    args = ["partition", "--profile", str(path), "--gpus", "2", "--schedule", "1f1b", "--microbatches", "2"]
    args += ["--cuts", cut, "--replicas", "1,1"] if cut else ["--straight"]
    cli(*args, "-o", out)
    package = next((cli.folder / out).glob("*/gpus=2"))
    return {"package": package, "plan": json.loads((package / "plan.json").read_text())}


def train(cli: Cli, package: Path, steps: int) -> dict[str, Any]:
    """``pipeplan run``: the metrics a precision is compared by."""
    load = cli(
        "run",
        str(package.relative_to(cli.folder)),
        "--steps",
        str(steps),
        "--timeout",
        "600",
        "--no-checkpoint",
    )
    metrics = json.loads((package / "run" / "metrics.json").read_text())
    ranks = sorted(metrics["ranks"], key=lambda r: r["rank"])
    return {
        "time_per_minibatch_s": metrics["time_per_minibatch_s"],
        "predicted_s": metrics["predicted_time_per_minibatch_s"],
        "stage_compute_s": [s["compute_s_per_minibatch"] for s in metrics["stages"]],
        "compute_cpu_s": sum(r["compute_cpu_s"] / max(1, len(r["step_times_s"])) for r in ranks),
        "peak_memory_bytes": [r["peak_memory_bytes"] for r in ranks],
        "cpu_share": sum(r["compute_cpu_s"] for r in ranks) / max(1e-9, sum(r["compute_s"] for r in ranks)),
        "losses": metrics["losses"],
        "skipped_steps": sorted({s for r in ranks for s in r.get("skipped_steps", ())}),
        "loss_scale": next((r["loss_scale"] for r in ranks if r.get("loss_scale")), None),
        "load_1min": load,
    }


def bench_model(cli: Cli, model: Model, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every precision of one model: its profile, plan and the median of its runs."""
    rows: dict[str, dict[str, Any]] = {}
    cut = None
    for precision in args.precisions:
        path, summary = profile(cli, model, precision, args.repeats)
        made = partition(cli, path, f"plans/{model.spec.replace(':', '-')}-{precision}", cut)
        plan = made["plan"]
        cut = cut or plan["stages"][0]["nodes"][-1]
        outputs = summary.pop("output_bytes")
        rows[precision] = {
            **summary,
            "cut": cut,
            "cut_bytes": outputs[cut],
            "predicted_memory_bytes": [s["memory_bytes"] for s in plan["stages"]],
            "package": made["package"],
            "runs": [],
        }
        print(f"{model.spec:9s} {precision} profiled: {summary['compute_ms']:.1f} ms", flush=True)
    for round_ in range(args.rounds):
        order = args.precisions if round_ % 2 == 0 else args.precisions[::-1]
        for precision in order:
            steps = args.steps if precision != "fp16" else args.fp16_steps
            result = train(cli, rows[precision]["package"], steps)
            rows[precision]["runs"].append(result)
            print(
                f"{model.spec:9s} {precision} round {round_}: {result['time_per_minibatch_s']:.4f} s",
                flush=True,
            )
    out = []
    for precision in args.precisions:
        row = rows[precision]
        row["package"] = str(Path(row["package"]).relative_to(cli.folder))
        runs = row["runs"]
        row["time_per_minibatch_s"] = statistics.median(r["time_per_minibatch_s"] for r in runs)
        row["compute_cpu_s"] = statistics.median(r["compute_cpu_s"] for r in runs)
        row["run_load_1min"] = statistics.median(r["load_1min"] for r in runs)
        row["peak_memory_bytes"] = [
            statistics.median(r["peak_memory_bytes"][k] for r in runs)
            for k in range(len(runs[0]["peak_memory_bytes"]))
        ]
        out.append(row)
    base = out[0]
    for row in out:
        row["time_vs_fp32"] = row["time_per_minibatch_s"] / base["time_per_minibatch_s"]
        row["compute_cpu_vs_fp32"] = row["compute_cpu_s"] / base["compute_cpu_s"]
        row["compute_vs_fp32"] = row["compute_ms"] / base["compute_ms"]
        row["kept_vs_fp32"] = (row["saved_bytes"] + row["cast_bytes"]) / max(1, base["saved_bytes"])
        losses, reference = row["runs"][0]["losses"], base["runs"][0]["losses"]
        row["loss_compared_at_step"] = len(losses)  # fp16 runs fewer steps: compare at its last
        row["loss_vs_fp32"] = losses[-1] / reference[len(losses) - 1] - 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="Minibatches per fp32 and bf16 run.")
    parser.add_argument("--fp16-steps", type=int, default=4, help="Minibatches per fp16 run (slow on CPUs).")
    parser.add_argument("--rounds", type=int, default=3, help="Runs per model and precision.")
    parser.add_argument("--repeats", type=int, default=3, help="Profile repeats per layer.")
    parser.add_argument("--models", default=",".join(m.spec for m in MODELS), help="Subset, comma-separated.")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="fp32 first, comma-separated.")
    parser.add_argument("--keep", default=None, help="Work in this folder (kept) instead of a temporary one.")
    args = parser.parse_args()
    args.precisions = tuple(args.precisions.split(","))
    if args.precisions[0] != "fp32":
        parser.error("--precisions must start with fp32, the baseline")
    chosen = [m for m in MODELS if m.spec in args.models.split(",")]
    started, load_before = time.perf_counter(), os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        cli = Cli(folder)
        for model in chosen:
            rows += bench_model(cli, model, args)
    report(args, rows, (load_before, os.getloadavg()), time.perf_counter() - started)


def report(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    load: tuple[tuple[float, ...], tuple[float, ...]],
    wall_s: float,
) -> None:
    """precision.json (every profile, plan and run) and precision.md."""

    doc = {
        "benchmark": "bench_precision",
        "setup": {**vars(args), "ranks": 2, "backend": "gloo", "schedule": "1f1b", "microbatches": 2,
                  "profile": "--threads 1 --clock cpu --microbatch-size batch/2"},
        "machine": machine(load, cpu_flags=_cpu_flags(),
                           note="CPU shared with other jobs; load_1min recorded before every command"),
        "wall_s": round(wall_s, 1),
        "rows": rows,
    }  # fmt: skip
    md = _markdown(doc)
    write_results(RESULTS, "precision", doc, md)
    print("\n".join(md))


def _cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "f16c")
    return [f for f in wanted if f" {f} " in text or f" {f}\n" in text]


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def _markdown(doc: dict[str, Any]) -> list[str]:
    load, setup, machine = doc["machine"]["load_average_before_after"], doc["setup"], doc["machine"]
    lines = [
        "# bench_precision: bf16 and fp16 (autocast, float32 weights) against fp32",
        "",
        f"2 gloo ranks on a {machine['cpu_count']}-core CPU ({', '.join(machine['cpu_flags'])}) shared with "
        f"other jobs (1-min load average {load[0][0]:.2f} before, {load[1][0]:.2f} after), torch "
        f"{machine['torch']}. Per model and precision: `pipeplan profile MODEL --precision P --threads 1 "
        f"--clock cpu --repeats {setup['repeats']} --microbatch-size B/2`, a straight 2-stage 1f1b plan with "
        "2 microbatches (the fp32 profile's cut, the same for every precision), `pipeplan run PKG` "
        f"({setup['steps']} steps; fp16 {setup['fp16_steps']}), {setup['rounds']} rounds in alternating "
        f"order, median round. Whole benchmark {doc['wall_s']:.0f} s.",
        "",
        "Profile (per minibatch, CPU clock): forward + backward of all layers, the bytes autograd keeps "
        "for backward (activations; autocast's low-precision weight copies apart, one per forward), the "
        "bytes crossing the cut. Plan: predicted memory per device (float32 weights, gradients and "
        "optimizer state, plus what the microbatches in flight keep). Run: measured time per minibatch "
        "(wall) and the ranks' compute CPU time per minibatch (both stages; steadier on a busy machine), "
        "each rank's peak memory (metrics.json's peak_memory_bytes), the loss of its last step against "
        "fp32's at the same step. Load: the median 1-minute load average before the runs.",
        "",
        "| model | precision | layers fwd+bwd ms | vs fp32 | kept MiB (+copies) | cut MiB "
        "| predicted MiB per stage | run s/minibatch | vs fp32 | run CPU ms | vs fp32 "
        "| peak RSS MiB per rank | loss vs fp32 (step) | skipped (fp16) | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in doc["rows"]:
        copies = f" (+{_mib(r['cast_bytes'])})" if r["cast_bytes"] else ""
        skipped = (f"{r['runs'][0]['skipped_steps'] or 'none'}, scale {r['runs'][0]['loss_scale']:g}"
                   if r["precision"] == "fp16" else "")  # fmt: skip
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['compute_ms']:.1f} | {r['compute_vs_fp32']:.2f} "
            f"| {_mib(r['saved_bytes'])}{copies} | {_mib(r['cut_bytes'])} "
            f"| {' / '.join(_mib(m) for m in r['predicted_memory_bytes'])} "
            f"| {r['time_per_minibatch_s']:.4f} | {r['time_vs_fp32']:.2f} "
            f"| {1e3 * r['compute_cpu_s']:.1f} | {r['compute_cpu_vs_fp32']:.2f} "
            f"| {' / '.join(_mib(m) for m in r['peak_memory_bytes'])} "
            f"| {100 * r['loss_vs_fp32']:+.2f}% ({r['loss_compared_at_step']}) "
            f"| {skipped} | {r['run_load_1min']:.2f} |"
        )
    return lines


if __name__ == "__main__":
    main()
