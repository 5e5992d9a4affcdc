"""pipeplan's 1f1b, gpipe and zb1p (zero bubble H1) on the same 2-stage split and microbatches, on
2 gloo ranks of this CPU: measured time per minibatch, measured vs predicted bubble, and the
throughput ratio against torch.distributed.pipelining's Schedule1F1B and ScheduleInterleavedZeroBubble
(one stage per rank) on the same stage modules.

The package is bench_runtime's MLP (Linear+ReLU layers, cut in two). Measured bubble, per step: 1 -
(compute seconds of both ranks) / (2 x the step's wall time, the slower rank's), median over the steps
after warm-up; compute is what the runtime's recorder times (F, B, W and the optimizer step). The
predicted bubble is the planner's closed form (partitioner/optimizer/pricing/schedules.py) fed with
each stage's
forward and backward per microbatch measured by bench_runtime's probe (both ranks computing at once,
as in the pipeline), no communication: 1f1b and gpipe ``1 - sum(M t_k) / (p (sum t_k + (M-1) max t_k))``,
zb1p :func:`partitioner.optimizer.pricing.schedules.zero_bubble_time` with W = half the backward.
Runs alternate
between the runtimes and repeat, because this machine is shared.

Run:  .venv/bin/python -m benchmarks.bench_schedules   (writes benchmarks/results/bench_schedules.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_runtime import _elastic, probe, write_package
from partitioner.optimizer.pricing.schedules import zero_bubble_time
from runtime.launch import launch
from runtime.options import RunOptions
from runtime.package import import_package

RESULTS = Path(__file__).resolve().parent / "results"
OURS = ("1f1b", "gpipe", "zb1p")
THEIRS = ("torch Schedule1F1B", "torch ScheduleInterleavedZeroBubble")


def predicted_bubble(schedule: str, f: list[float], b: list[float], m: int) -> float:
    """The planner's closed-form bubble for per-stage forward ``f`` and backward ``b`` per microbatch."""
    work = sum(m * (fk + bk) for fk, bk in zip(f, b, strict=True))
    if schedule == "zb1p":
        span = zero_bubble_time(f, b, [0.0] * len(f), m)
    else:
        t = [fk + bk for fk, bk in zip(f, b, strict=True)]
        span = sum(t) + (m - 1) * max(t)
    return 1.0 - work / (len(f) * span)


def run_ours(package: Path, schedule: str, steps: int, micro: int, warmup: int) -> dict[str, float]:
    """One ``pipeplan run``-like job: median time per minibatch and median measured bubble."""
    metrics = launch(
        RunOptions(str(package), steps=steps, microbatches=micro, schedule=schedule, backend="gloo")
    )
    assert metrics is not None
    ranks = metrics["ranks"]
    walls = [max(ts) for ts in zip(*(r["step_times_s"] for r in ranks), strict=True)][warmup:]
    busy = [sum(cs) for cs in zip(*(r["step_compute_s"] for r in ranks), strict=True)][warmup:]
    bubbles = [1.0 - c / (len(ranks) * w) for c, w in zip(busy, walls, strict=True)]
    cpu = sum(r.get("compute_cpu_s", 0.0) for r in ranks) / len(ranks[0]["step_times_s"])
    return {
        "s_per_minibatch": statistics.median(walls),
        "bubble": statistics.median(bubbles),
        "compute_cpu_s_per_minibatch": cpu,
    }


def _torch_rank(package: str, name: str, steps: int, micro: int, batch: int) -> list[float]:
    """One rank of a torch.distributed.pipelining schedule on the package's stage."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    pkg = import_package(package)
    module = pkg.stage(rank)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    loss_fn = pkg.criterion()
    schedule: Any
    if name.endswith("Schedule1F1B"):
        schedule = Schedule1F1B(stage, micro, loss_fn=lambda out, y: loss_fn(out, y))
    else:
        schedule = ScheduleInterleavedZeroBubble([stage], micro, loss_fn=lambda out, y: loss_fn(out, y))
    optim = torch.optim.SGD(module.parameters(), lr=0.01)
    times = []
    for step in range(steps):
        torch.manual_seed(step)
        x, y = pkg.example_inputs(batch)["x"], pkg.example_targets(batch)
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        optim.step()
        optim.zero_grad()
        times.append(time.perf_counter() - start)
    dist.barrier()
    dist.destroy_process_group()
    return times


def run_theirs(package: Path, name: str, steps: int, micro: int, batch: int, warmup: int) -> dict[str, float]:
    per_rank = _elastic(_torch_rank, str(package), name, steps, micro, batch)
    walls = [max(a, b) for a, b in zip(per_rank[0], per_rank[1], strict=True)][warmup:]
    return {"s_per_minibatch": statistics.median(walls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--probe-seconds", type=float, default=1.5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        b, m = args.batch_size, args.microbatches
        package = write_package(Path(tmp) / "pkg", args.width, args.layers, b, m)
        for r in range(args.repeats):
            got: dict[str, Any] = {"load_1min": os.getloadavg()[0]}
            names = [*OURS, *THEIRS]
            for name in names if r % 2 == 0 else names[::-1]:
                try:
                    if name in OURS:
                        got[name] = run_ours(package, name, args.steps, m, args.warmup)
                    else:
                        got[name] = run_theirs(package, name, args.steps, m, b, args.warmup)
                except Exception as exc:  # a torch schedule that cannot run this split: say why
                    got[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            got["probe"] = probe(package, b, m, args.probe_seconds)
            rounds.append(got)
    report(args, rounds, (load_before, os.getloadavg()))


def _median(rounds: list[dict[str, Any]], name: str, key: str) -> float | None:
    values = [r[name][key] for r in rounds if key in r.get(name, {})]
    return statistics.median(values) if values else None


def report(args: argparse.Namespace, rounds: list[dict[str, Any]], load: tuple[Any, Any]) -> None:
    m = args.microbatches
    f = [statistics.median(r["probe"][k]["corun"]["f"] for r in rounds) for k in (0, 1)]
    bw = [statistics.median(r["probe"][k]["corun"]["b"] for r in rounds) for k in (0, 1)]
    rows: dict[str, dict[str, Any]] = {}
    for name in (*OURS, *THEIRS):
        rows[name] = {
            "s_per_minibatch": _median(rounds, name, "s_per_minibatch"),
            "measured_bubble": _median(rounds, name, "bubble"),
            "compute_cpu_s_per_minibatch": _median(rounds, name, "compute_cpu_s_per_minibatch"),
            "predicted_bubble": predicted_bubble(name, f, bw, m) if name in OURS else None,
            "errors": sorted({r[name]["error"] for r in rounds if "error" in r.get(name, {})}),
        }
    base = rows["1f1b"]["s_per_minibatch"]
    for row in rows.values():
        t = row["s_per_minibatch"]
        row["speedup_vs_pipeplan_1f1b"] = base / t if base and t else None
    doc = {
        "config": vars(args),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "load_1min_before_after": [load[0][0], load[1][0]],
        "stage_forward_s_per_microbatch": f,
        "stage_backward_s_per_microbatch": bw,
        "results": rows,
        "rounds": rounds,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_schedules.json").write_text(json.dumps(doc, indent=1) + "\n")
    (RESULTS / "bench_schedules.md").write_text(_markdown(doc))
    print(_markdown(doc))


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _markdown(doc: dict[str, Any]) -> str:
    cfg, load = doc["config"], doc["load_1min_before_after"]
    lines = [
        "# bench_schedules: 1f1b, gpipe and zb1p on one split, 2 gloo ranks on CPU",
        "",
        f"MLP {cfg['layers']} x {cfg['width']}, batch {cfg['batch_size']}, {cfg['microbatches']} "
        f"microbatches, {cfg['steps']} steps ({cfg['warmup']} warm-up dropped), {cfg['repeats']} alternating "
        f"rounds; load (1 min) {load[0]:.1f} before, {load[1]:.1f} after on {doc['host']['cpus']} CPUs.",
        "",
        "| schedule | s / minibatch | vs pipeplan 1f1b | measured bubble | predicted bubble "
        "| compute CPU s |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in doc["results"].items():
        note = f" (failed: {row['errors'][0]})" if row["errors"] and row["s_per_minibatch"] is None else ""
        lines.append(
            f"| {name}{note} | {_fmt(row['s_per_minibatch'], '.4f')} | "
            f"{_fmt(row['speedup_vs_pipeplan_1f1b'], '.2f')} | {_fmt(row['measured_bubble'], '.2f')} | "
            f"{_fmt(row['predicted_bubble'], '.2f')} | {_fmt(row['compute_cpu_s_per_minibatch'], '.3f')} |"
        )
    f, b = doc["stage_forward_s_per_microbatch"], doc["stage_backward_s_per_microbatch"]
    lines += [
        "",
        f"Probe (per microbatch, both ranks busy): forward {f[0] * 1e3:.1f} / {f[1] * 1e3:.1f} ms, "
        f"backward {b[0] * 1e3:.1f} / {b[1] * 1e3:.1f} ms (stage 0 / 1).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
