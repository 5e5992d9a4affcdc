"""The chosen plan against what users of other tools would run, priced by the same cost model.

Two settings, as the optimizer's benchmarks take them: PipeDream's profiles at 4, 8, 16 GPUs and a 4x4
hierarchy under pipedream's schedule (``bench_optimizer``), and at 4, 8, 16 GPUs under 1F1B with 8
microbatches (``bench_sync``); SGD. For each case: DeepSpeed's parameter and uniform partitioning and
torchgpipe's time balancing, each two ways: one GPU per stage (as those benchmarks report them), and
with the data-parallel width their users would pick (the fastest width dividing the GPUs, one
included: DeepSpeed's pipeline times its data-parallel width is the world size); plain data
parallelism; and our best plan without replication (``--straight``). The ratios are predicted time per
minibatch, baseline / chosen (above 1: the chosen plan is faster). Deterministic: no timing, so the
machine's load does not matter.

    .venv/bin/python benchmarks/bench_baselines.py [--profiles DIR] [--only NAME,..]

Writes benchmarks/results/bench_baselines.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
from bench_optimizer import CLUSTERS, RESULTS, profile_args, selected_profiles

from partitioner.graph import Profile
from partitioner.optimizer import solve
from partitioner.optimizer.planner import alternatives
from partitioner.optimizer.search.candidates import parameter_balanced, time_balanced, uniform
from partitioner.plan import Cluster
from runtime.files.atomic import write_text_atomic

METHODS = {
    "parameter balanced": parameter_balanced,
    "time balanced": time_balanced,
    "uniform layers": uniform,
}


SETTINGS = {
    "pipedream": ("pipedream", 1, CLUSTERS),
    "1f1b x 8": ("1f1b", 8, {str(g): Cluster.flat(g, 1e9) for g in (4, 8, 16)}),
}


def case(profile: Profile, cluster: Cluster, schedule: str, m: int) -> dict[str, Any]:
    """The chosen plan's time and each baseline's ratio to it (None: does not fit)."""
    chosen = solve(profile, cluster, schedule, m).predicted.time_per_minibatch_s
    row: dict[str, Any] = {"chosen_ms": 1e3 * chosen, "one_gpu_per_stage": {}, "hybrid": {}, "width": {}}
    for name, make in METHODS.items():
        row["one_gpu_per_stage"][name] = (
            make(profile, cluster, schedule, m, "sgd").predicted.time_per_minibatch_s / chosen
        )
    for name, plan in alternatives(profile, cluster, schedule, m, "sgd").items():
        ratio = None if plan is None else plan.predicted.time_per_minibatch_s / chosen
        if name in METHODS:
            row["hybrid"][name] = ratio
            row["width"][name] = None if plan is None else plan.stages[0].replicas
        else:
            row[name.replace(" ", "_")] = ratio
    simple = [r for r in (*row["hybrid"].values(), row["data_parallel"]) if r is not None]
    row["best_of_theirs"] = min(simple)
    row["best_simple"] = min([*simple, *([row["best_straight"]] if row["best_straight"] else [])])
    return row


def geomean(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values)))) if values else 0.0


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Geometric means over the cases, and the smallest ratio of each."""
    out: dict[str, Any] = {}
    for kind in ("one_gpu_per_stage", "hybrid"):
        for name in METHODS:
            vals = [r[kind][name] for r in rows if r[kind][name] is not None]
            out[f"{kind}/{name}"] = {"geomean": geomean(vals), "min": min(vals), "cases": len(vals)}
    for key in ("data_parallel", "best_straight", "best_of_theirs", "best_simple"):
        vals = [r[key] for r in rows if r[key] is not None]
        out[key] = {"geomean": geomean(vals), "min": min(vals), "cases": len(vals)}
    return out


def table(setting: str, s: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """One setting's summary and its cases."""
    out = [f"## {setting}", "", "| baseline | geometric mean | smallest | cases |", "|---|---|---|---|"]
    labels = [(f"{k}/{n}", f"{n}, {'one GPU per stage' if k == 'one_gpu_per_stage' else 'hybrid'}")
              for k in ("one_gpu_per_stage", "hybrid") for n in METHODS]  # fmt: skip
    labels += [("data_parallel", "data parallel"), ("best_straight", "best straight (ours, no replication)"),
               ("best_of_theirs", "best of theirs"), ("best_simple", "best simple plan")]  # fmt: skip
    for key, label in labels:
        out.append(f"| {label} | {s[key]['geomean']:.2f}x | {s[key]['min']:.2f}x | {s[key]['cases']} |")
    out += ["", "| profile | GPUs | chosen ms | param 1/hyb (w) | time 1/hyb (w) | uniform 1/hyb (w) | DP |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip

    def cell(r: dict[str, Any], name: str) -> str:
        hyb = r["hybrid"][name]
        return f"{r['one_gpu_per_stage'][name]:.2f} / " + (
            "-" if hyb is None else f"{hyb:.2f} ({r['width'][name]})"
        )

    for r in rows:
        dp = "-" if r["data_parallel"] is None else f"{r['data_parallel']:.2f}"
        cells = " | ".join(cell(r, name) for name in METHODS)
        out.append(f"| {r['profile']} | {r['cluster']} | {r['chosen_ms']:.3f} | {cells} | {dp} |")
    return [*out, ""]


def markdown(doc: dict[str, Any]) -> str:
    out = [
        "# The chosen plan against other tools' plans (predicted)",
        "",
        f"`{doc['command']}`: PipeDream's profiles, SGD; each setting as the optimizer's benchmark of that",
        "schedule takes it. Ratio: the baseline's predicted time per minibatch / the chosen plan's (above",
        "1: the chosen plan is faster). *hybrid*: the method with the data-parallel width its users would",
        "pick (the fastest that divides the GPUs; the width in brackets); *best of theirs*: the fastest of",
        "data parallelism and the three hybrids, per case; *best simple*: that or our best plan without",
        "replication. Cells: one GPU per stage / hybrid (width).",
        "",
    ]
    for setting, part in doc["settings"].items():
        out += table(setting, part["summary"], part["cases"])
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    profile_args(parser)
    args = parser.parse_args()
    profiles = list(selected_profiles(args))
    settings: dict[str, Any] = {}
    for setting, (schedule, m, clusters) in SETTINGS.items():
        rows = []
        for name, profile in profiles:
            for label, cluster in clusters.items():
                rows.append({"profile": name, "cluster": label, **case(profile, cluster, schedule, m)})
                print(f"{setting} {name:14s} {label:4s} best of theirs {rows[-1]['best_of_theirs']:.2f}x",
                      flush=True)  # fmt: skip
        settings[setting] = {"schedule": schedule, "microbatches": m, "cases": rows, "summary": summary(rows)}
    command = "python benchmarks/bench_baselines.py" + (f" --only {args.only}" if args.only else "")
    doc = {"command": command, "settings": settings}
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_text_atomic(RESULTS / "bench_baselines.json", json.dumps(doc, indent=1) + "\n")
    write_text_atomic(RESULTS / "bench_baselines.md", markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
