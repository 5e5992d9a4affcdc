"""pipeplan's 1f1b, gpipe and zb1p (zero bubble H1) on the same 2-stage split and microbatches, on
2 gloo ranks of this CPU: measured time per minibatch, measured vs predicted bubble, and the
throughput ratio of each against its torch.distributed.pipelining counterpart on the same stage
modules: Schedule1F1B, ScheduleGPipe and ScheduleInterleavedZeroBubble (one stage per rank).

Each pair runs back to back in every round, the order reversed every other round, both sides set
up, fed and timed alike (benchmarks/peers.py); a pair's headline is the median of its per-round
ratios.

The package is bench_runtime's MLP (Linear+ReLU layers, cut in two). Measured bubble, per step: 1 -
(compute seconds of both ranks) / (2 x the step's wall time, the slower rank's), median over the steps
after warm-up; compute is what the runtime's recorder times (F, B, W and the optimizer step). The
predicted bubble is the planner's closed form (partitioner/optimizer/pricing/schedules.py) fed with
each stage's
forward and backward per microbatch measured by bench_runtime's probe (both ranks computing at once,
as in the pipeline), no communication: 1f1b and gpipe ``1 - sum(M t_k) / (p (sum t_k + (M-1) max t_k))``,
zb1p :func:`partitioner.optimizer.pricing.schedules.zero_bubble_time` with W = half the backward.
Rounds repeat
because this machine is shared.

Run:  .venv/bin/python -m benchmarks.bench_schedules   (writes benchmarks/results/bench_schedules.{json,md})
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_runtime import probe, write_package
from benchmarks.peers import (
    TORCH_SCHEDULES,
    median_ratio,
    paired,
    pairs_markdown,
    round_order,
    run_pipeplan,
    run_torch,
)
from partitioner.optimizer.pricing.schedules import zero_bubble_time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, run as a script
from benchmarks.reporting import write_results

RESULTS = Path(__file__).resolve().parent / "results"
OURS = ("1f1b", "gpipe", "zb1p")
THEIRS = tuple(f"torch {TORCH_SCHEDULES[name]}" for name in OURS)
PAIRS = tuple(zip(OURS, THEIRS, strict=True))


def predicted_bubble(schedule: str, f: list[float], b: list[float], m: int) -> float:
    """The planner's closed-form bubble for per-stage forward ``f`` and backward ``b`` per microbatch."""
    work = sum(m * (fk + bk) for fk, bk in zip(f, b, strict=True))
    if schedule == "zb1p":
        span = zero_bubble_time(f, b, [0.0] * len(f), m)
    else:
        t = [fk + bk for fk, bk in zip(f, b, strict=True)]
        span = sum(t) + (m - 1) * max(t)
    return 1.0 - work / (len(f) * span)


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
            for name in round_order(PAIRS, r):
                try:
                    if name in OURS:
                        got[name] = run_pipeplan(package, name, args.steps, m, args.warmup)[0]
                    else:
                        schedule = OURS[THEIRS.index(name)]
                        got[name] = run_torch(package, schedule, args.steps, m, args.warmup)
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
    pairs = {ours: paired(rounds, ours, theirs) for ours, theirs in PAIRS}
    doc = {
        "config": vars(args),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "load_1min_before_after": [load[0][0], load[1][0]],
        "stage_forward_s_per_microbatch": f,
        "stage_backward_s_per_microbatch": bw,
        "results": rows,
        "torch_over_pipeplan_per_round": pairs,
        "torch_over_pipeplan_median": {name: median_ratio(ratios) for name, ratios in pairs.items()},
        "rounds": rounds,
    }
    write_results(RESULTS, "bench_schedules", doc, _markdown(doc))
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
    loads = [r["load_1min"] for r in doc["rounds"]]
    lines += [
        "",
        *pairs_markdown(
            PAIRS, doc["torch_over_pipeplan_per_round"], doc["torch_over_pipeplan_median"], loads
        ),
    ]
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
