"""3D layouts by hand: every model x layout x schedule of issue 39's matrix trained 4 SGD steps on CPU
ranks over gloo and compared with plain single-process training, with the run's step time.

    PYTHONPATH=. python benchmarks/bench_3d.py [--only llama] [--out benchmarks/results/bench_3d]

Writes NAME.json and NAME.md: per run, the largest weight error relative to its tensor's largest
value (the test suite's criterion is 1e-5), the median step time after the first, and, for the
step-time comparison, the same model replicated (PP2 x DP2, no sharding). The plans are made by
rewriting a 2D plan's stages (tests/runtime/packages3d.py): no 3D price exists yet (issue 40), so
there is no predicted time to set beside the measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

LAYOUTS: dict[str, list[tuple[int, int, str]]] = {
    "PP2 x DP2 replicated": [(1, 2, "none")] * 2,
    "PP2 x TP2": [(2, 1, "none")] * 2,
    "PP2 x DP2 optimizer": [(1, 2, "optimizer")] * 2,
    "PP2 x DP2 gradients": [(1, 2, "gradients")] * 2,
    "PP2 x DP2 full": [(1, 2, "full")] * 2,
    "PP2 x DP2 x TP2": [(2, 2, "none")] * 2,
    "PP2 x DP2 x TP2 full": [(2, 2, "full")] * 2,
}
SCHEDULES = ("1f1b", "zbv")
SGD = {"lr": 0.05, "momentum": 0.9}


def _error(ckpt: Path, stages: int, want: dict[str, Any]) -> float:
    from runtime.checkpoints.read_tensors import read_stage

    worst = 0.0
    for k in range(stages):
        for name, got in read_stage(ckpt, 4, k).items():
            ref = want[name]
            worst = max(worst, float((got - ref).abs().max()) / (float(ref.abs().max()) or 1.0))
    return worst


def _one(
    tmp: Path,
    profile: Any,
    name: str,
    layout: list[tuple[int, int, str]],
    schedule: str,
    backend: str,
    most: int,
) -> dict[str, Any]:
    from runtime.errors import RunError
    from tests.runtime.helpers import run
    from tests.runtime.packages3d import generate_3d
    from tests.runtime.reference3d import plain_state

    laid_out = schedule in ("zbv", "interleaved")
    if laid_out:  # 4 stages on each copy's 2 groups of t ranks, as a V (zbv) or in turn (interleaved)
        layout = layout * 2
    ranks = sum(t * d for t, d, _ in layout) // (2 if laid_out else 1)
    if ranks > most:
        return {"result": f"skipped: needs {ranks} ranks, --most-ranks {most}"}
    pkg = generate_3d(tmp / name, profile, layout, schedule, 4, 8)
    ckpt = tmp / f"{name}-ckpt"
    began = time.perf_counter()
    try:
        metrics = run(pkg, steps=4, checkpoint_dir=str(ckpt), backend=backend, **SGD)
    except RunError as exc:
        return {"result": f"error: {exc}"}
    wall = time.perf_counter() - began
    error = _error(ckpt, len(layout), plain_state(pkg, 4, 4, 8, **SGD))
    return {
        "result": "equal" if error <= 1e-5 else "DIFFERENT",
        "max_rel_error": error,
        "time_per_minibatch_s": metrics.get("time_per_minibatch_s"),
        "ranks": metrics.get("world_size"),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=None, help="only the models whose name contains this")
    parser.add_argument("--layout", default=None, help="only the layouts whose name contains this")
    parser.add_argument(
        "--schedule", default=None, help="only this schedule (by hand: also gpipe, zb1p, interleaved)"
    )
    parser.add_argument("--out", default="benchmarks/results/bench_3d")
    parser.add_argument("--backend", default="gloo", help="gloo (CPU ranks) or nccl (a GPU per rank)")
    parser.add_argument("--most-ranks", type=int, default=8, help="skip layouts needing more ranks")
    args = parser.parse_args()
    from partitioner.profiler import profile as profiler
    from tests.runtime.packages3d import bench_models

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        specs = bench_models(tmp)
        for model, spec in specs.items():
            if args.only and args.only not in model:
                continue
            profile = profiler.profile_model(spec, batch_size=8, repeats=1)
            for layout_name, layout in LAYOUTS.items():
                if args.layout and args.layout not in layout_name:
                    continue
                for schedule in SCHEDULES if args.schedule is None else (args.schedule,):
                    name = f"{model}-{layout_name}-{schedule}".replace(" ", "_").replace(":", "_")
                    row = {"model": model, "layout": layout_name, "schedule": schedule}
                    row.update(_one(tmp, profile, name, layout, schedule, args.backend, args.most_ranks))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    lines = [
        "| model | layout | schedule | ranks | result | max rel. error | s / minibatch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        err = f"{r['max_rel_error']:.1e}" if "max_rel_error" in r else ""
        t = f"{r['time_per_minibatch_s']:.3f}" if r.get("time_per_minibatch_s") else ""
        cells = [r["model"], r["layout"], r["schedule"], r.get("ranks", ""), r["result"], err, t]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    load = os.getloadavg()[0]
    head = [
        "# 3D layouts against plain training (benchmarks/bench_3d.py)",
        "",
        f"`PYTHONPATH=. python benchmarks/bench_3d.py`, {args.backend}, 4 SGD steps (lr 0.05, momentum 0.9),",
        "4 microbatches of a batch of 8; error: the largest weight difference over its tensor's largest",
        "value",
        f"(the suite's bound is 1e-5). 1-minute load at the end {load:.1f} on {os.cpu_count()} cores: the",
        "times are the contention's as much as the layouts'. zbv lays 4 stages on each copy's 2 groups",
        "of t ranks as a V; its copies are V pipelines of their own, and a shard level reduces its",
        "gradients once, after the last W (docs/layout-3d.md).",
        "",
    ]
    lines = head + lines
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
