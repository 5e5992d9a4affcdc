"""How fast and how faithful is `pipeplan profile` on this CPU?

For vgg16 (batch 8, 224x224), resnet50 (batch 8, 224x224) and gpt2 (batch 2, 128 tokens) it records:
- wall time of ``profile_model`` (model build, trace, per-layer measurement, whole-step timing);
- one plain training step (forward + loss + backward) of the same model, measured separately;
- overhead = profile wall time / plain step;
- fidelity = sum of per-layer forward+backward times / whole step (1.0 = the parts add up to the whole).

Run: ``.venv/bin/python benchmarks/bench_profile.py [--models vgg16,resnet50,gpt2] [--repeats 3]``.
Writes benchmarks/results/bench_profile.{json,md}. Targets (issue 2): vgg16 at batch 8 in under 60 s on
2 cores; fidelity within 0.8 to 1.2 for all three.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from partitioner.models.specs import load_model
from partitioner.profiler.profile import profile_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, run as a script
from benchmarks.reporting import write_results

CASES: dict[str, tuple[int, tuple[int, ...]]] = {
    "vgg16": (8, (3, 224, 224)),
    "resnet50": (8, (3, 224, 224)),
    "gpt2": (2, (128,)),
}
RESULTS = Path(__file__).parent / "results"


def plain_step_s(name: str, batch: int, shape: tuple[int, ...], runs: int = 2) -> float:
    """Median of ``runs`` plain training steps after one warm-up: what a user's own loop would take."""
    bundle = load_model(name, batch, shape)
    times = []
    for run in range(runs + 1):
        bundle.module.zero_grad(set_to_none=True)
        started = time.perf_counter()
        bundle.loss_fn(bundle.module(*bundle.inputs), bundle.targets).backward()  # type: ignore[no-untyped-call]
        if run:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench(name: str, repeats: int, clock: str) -> dict[str, Any]:
    batch, shape = CASES[name]
    load_before = os.getloadavg()[0]
    step = plain_step_s(name, batch, shape)
    started = time.perf_counter()
    profile = profile_model(name, batch, shape, device="cpu", repeats=repeats, clock=clock)
    wall = time.perf_counter() - started
    return {
        "model": name,
        "batch_size": batch,
        "input_shape": list(shape),
        "layers": len(profile.layers),
        "profile_wall_s": round(wall, 2),
        "plain_step_s": round(step, 3),
        "overhead_x": round(wall / step, 1),
        "step_ms_in_profile": round(profile.step_ms or 0.0, 1),
        "sum_of_layers_ms": round(profile.total_compute_ms, 1),
        "fidelity": round(profile.fidelity or 0.0, 3),
        "loadavg_1min_before": round(load_before, 2),
        "loadavg_1min_after": round(os.getloadavg()[0], 2),
    }


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# bench_profile: `pipeplan profile` on CPU",
        "",
        f"torch {doc['torch']}, {doc['threads']} threads, {doc['cpus']} CPUs ({doc['machine']}), "
        f"repeats={doc['repeats']}, clock={doc['clock']}. "
        "Shared machine: the 1-minute load average is recorded per row.",
        "",
        "| model | batch | input | layers | profile wall s | plain step s | overhead x | fidelity | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        lines.append(
            f"| {r['model']} | {r['batch_size']} | {'x'.join(map(str, r['input_shape']))} | {r['layers']} | "
            f"{r['profile_wall_s']} | {r['plain_step_s']} | {r['overhead_x']} | {r['fidelity']} | "
            f"{r['loadavg_1min_before']} -> {r['loadavg_1min_after']} |"
        )
    lines += ["", "Targets: vgg16 batch 8 profile under 60 s on 2 cores; fidelity 0.8-1.2.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="profile_model's clock")
    parser.add_argument("--out", default="bench_profile", help="result file stem under benchmarks/results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for name in args.models.split(","):
        results.append(bench(name, args.repeats, args.clock))
        print(json.dumps(results[-1]), flush=True)
    doc = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "repeats": args.repeats,
        "clock": args.clock,
        "results": results,
    }
    write_results(RESULTS, args.out, doc, markdown(doc))


if __name__ == "__main__":
    main()
