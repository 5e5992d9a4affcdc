"""How close is `pipeplan profile --device-model` to a measurement of the same layers?

Two comparisons, each per layer (estimated / measured forward + backward time: median and the 10th
to 90th percentile spread, the layers furthest off) and in total (`partitioner.profiler.compare.compare`):

1. ``cpu``: the device model built from this machine's measured matmul rate, copy bandwidth and
   dispatch time, against profiles measured on this CPU, for three models of different kinds:
   resnet18 (convolutions, fx), gpt2 (a transformer, fx) and a 4-layer llama of hidden 512
   (benchmarks/configs/llama-h512.json, a transformer through torch.export). One thread, CPU-time
   clock (a shared machine's other jobs do not count), rounds alternating measure and estimate.
2. ``h100``: the preset against the committed H100 profiles (benchmarks/results/
   gpu_h100_2026-11-25/profiles: vgg16 and resnet50 at batch 32, gpt2 at 8 x 512 tokens in float32
   and under bf16 autocast, the 1.24B llama of benchmarks/gpu/llama-1b.json in bfloat16 at 4 x 512).
   Those profiles' layer sums exceed their measured whole step (per-layer timing on a GPU pays a
   synchronisation a step hides: fidelity 1.23 to 2.35), so the estimate is compared with both: the
   layer times, and its total against the measured step. The efficiency terms of the preset
   are cited figures (partitioner/hardware/devices.py), not fitted to these profiles.

Run:  .venv/bin/python benchmarks/bench_device_model.py [--rounds 2] [--skip-cpu] [--skip-h100]
(writes benchmarks/results/bench_device_model.{json,md})
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.reporting import write_results
from partitioner.graph import load_profile
from partitioner.profiler.compare import compare
from partitioner.profiler.profile import profile_model

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
GPU = RESULTS / "gpu_h100_2026-11-25" / "profiles"

CPU_CASES: dict[str, tuple[str, int, tuple[int, ...]]] = {
    "resnet18": ("resnet18", 8, (3, 112, 112)),
    "gpt2": ("gpt2", 4, (64,)),
    "llama-h512": (f"hf:{HERE / 'configs' / 'llama-h512.json'}", 4, (128,)),
}
H100_CASES: dict[str, dict[str, Any]] = {
    "vgg16": {"spec": "vgg16", "batch": 32, "shape": (3, 224, 224)},
    "resnet50": {"spec": "resnet50", "batch": 32, "shape": (3, 224, 224)},
    "gpt2": {"spec": "gpt2", "batch": 8, "shape": (512,)},
    "gpt2-bf16": {"spec": "gpt2", "batch": 8, "shape": (512,), "precision": "bf16"},
    "llama-1b-bf16": {
        "spec": f"hf:{HERE / 'gpu' / 'llama-1b.json'}", "batch": 4, "shape": (512,), "dtype": "bfloat16",
    },
}  # fmt: skip


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def cpu_round(name: str) -> dict[str, Any]:
    """One measure-then-estimate round of a model on this CPU, with the load around each."""
    spec, batch, shape = CPU_CASES[name]
    load = [_load()]
    started = time.perf_counter()
    measured = profile_model(spec, batch, shape, device="cpu", threads=1, clock="cpu", materialize="whole")
    measure_s = time.perf_counter() - started
    load.append(_load())
    started = time.perf_counter()
    estimated = profile_model(spec, batch, shape, threads=1, clock="cpu", device_model="cpu")
    estimate_s = time.perf_counter() - started
    load.append(_load())
    report = compare(measured, estimated)
    device = estimated.extra["estimate"]["device_model"]
    report.update(
        measure_s=round(measure_s, 1), estimate_s=round(estimate_s, 1), loadavg_1min=load,
        cpu_model={k: device[k] for k in ("peak_flops", "memory_bandwidth", "launch_s")},
    )  # fmt: skip
    return report


def h100_case(name: str) -> dict[str, Any]:
    """The h100 preset's estimate of a model against its committed H100 profile."""
    case = H100_CASES[name]
    measured = load_profile(GPU / f"{name}.json")
    started = time.perf_counter()
    estimated = profile_model(
        case["spec"], case["batch"], case["shape"], dtype=case.get("dtype", "float32"),
        precision=case.get("precision", "fp32"), device_model="h100",
    )  # fmt: skip
    report = compare(measured, estimated)
    report.update(estimate_s=round(time.perf_counter() - started, 1), fidelity=measured.fidelity)
    return report


def _ratio(s: dict[str, Any]) -> str:
    if not s.get("n"):
        return "-"
    return f"{s['median']:.2f} ({s['p10']:.2f}-{s['p90']:.2f})"


def _worst(report: dict[str, Any], k: int = 3) -> str:
    return "; ".join(
        f"{w['name']} {w['ratio']:.2f}x ({w['measured_ms']:.2f} ms)" for w in report["worst"][:k]
    )


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# bench_device_model: estimated layer times against measured ones",
        "",
        f"torch {doc['torch']}, {doc['machine']}, {doc['cpus']} CPUs; "
        f"`python benchmarks/bench_device_model.py --rounds {doc['rounds']}`; wall {doc['wall_s']} s. "
        "Ratio = estimated / measured forward+backward time of a layer: median (10th-90th "
        "percentile) over the layers.",
        "",
    ]
    if doc.get("cpu"):
        lines += [
            "## The `cpu` device model against this CPU (1 thread, CPU-time clock)",
            "",
            "| model | round | layers | ratio per layer | forward | backward | sum est/meas | worst layers "
            "| load |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, rounds in doc["cpu"].items():
            for i, r in enumerate(rounds):
                lines.append(
                    f"| {name} | {i + 1} | {r['layers']} | {_ratio(r['total'])} | {_ratio(r['forward'])} | "
                    f"{_ratio(r['backward'])} | {r['sum_ratio']:.2f} | {_worst(r)} | "
                    f"{', '.join(str(x) for x in r['loadavg_1min'])} |"
                )
        model = next(iter(doc["cpu"].values()))[0]["cpu_model"]
        lines += [
            "",
            "The cpu model of the first round: matmul "
            + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in model["peak_flops"].items())
            + f"; copy {model['memory_bandwidth'] / 1e9:.1f} GB/s; "
            f"dispatch {model['launch_s'] * 1e6:.1f} us.",
            "",
        ]
    if doc.get("h100"):
        lines += [
            "## The `h100` preset against the committed H100 profiles",
            "",
            "| model | layers | ratio per layer | forward | backward | sum est/meas layers "
            "| est / measured step "
            "| measured fidelity | worst layers |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in doc["h100"].items():
            lines.append(
                f"| {name} | {r['layers']} | {_ratio(r['total'])} | {_ratio(r['forward'])} | "
                f"{_ratio(r['backward'])} | {r['sum_ratio']:.2f} | {r['step_ratio']:.2f} | "
                f"{r['fidelity']:.2f} | {_worst(r)} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="measure/estimate rounds per CPU model")
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--skip-h100", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    doc: dict[str, Any] = {
        "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
    }  # fmt: skip
    if not args.skip_h100:
        doc["h100"] = {name: h100_case(name) for name in H100_CASES}
    if not args.skip_cpu:
        doc["cpu"] = {name: [] for name in CPU_CASES}
        for _ in range(args.rounds):
            for name in CPU_CASES:
                doc["cpu"][name].append(cpu_round(name))
    doc["wall_s"] = round(time.perf_counter() - started, 1)
    write_results(args.out, "bench_device_model", doc, markdown(doc), default=str)
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
