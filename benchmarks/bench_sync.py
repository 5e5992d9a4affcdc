"""Synchronous-schedule benchmark: 1F1B plans for PipeDream's profiles at 4, 8 and 16 GPUs.

For each case: the predicted time per minibatch of the chosen plan (sum of one microbatch's stage
times + (M-1) slowest + the largest all-reduce), the solve time, whether the branch and bound
proved it optimal over every downset, and the ratio of what other tools would pick (data
parallelism, DeepSpeed's parameter and uniform partitioning, torchgpipe's balance_by_time, and our
own best straight pipeline) to the chosen plan, all priced by the same model.

    .venv/bin/python benchmarks/bench_sync.py [--only NAME,..] [--microbatches 8]

Writes benchmarks/results/bench_sync.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

import numpy as np
from bench_optimizer import (  # run as a script: benchmarks/ is on the path
    RESULTS,
    profile_args,
    selected_profiles,
)

from partitioner.graph import Profile
from partitioner.optimizer import solve
from partitioner.optimizer.search.candidates import data_parallel, parameter_balanced, time_balanced, uniform
from partitioner.plan import Cluster
from runtime.files.atomic import write_text_atomic

BASELINES = {"data_parallel": data_parallel, "parameters": parameter_balanced, "uniform": uniform,
             "time": time_balanced}  # fmt: skip


def run_case(profile: Profile, gpus: int, m: int) -> dict[str, Any]:
    cluster = Cluster.flat(gpus, 1e9)
    start, cpu = time.perf_counter(), time.process_time()
    plan = solve(profile, cluster, "1f1b", m)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    t = plan.predicted.time_per_minibatch_s
    row: dict[str, Any] = {
        "gpus": gpus, "microbatches": m, "time_per_minibatch_s": t, "solve_time_s": wall,
        "solve_cpu_s": cpu, "optimal": plan.solver.optimal, "lower_bound_s": plan.solver.lower_bound_s,
        "replicas": [s.replicas for s in plan.stages], "states": plan.extra.get("states"),
    }  # fmt: skip
    for name, make in BASELINES.items():
        row[f"{name}_ratio"] = make(profile, cluster, "1f1b", m, "sgd").predicted.time_per_minibatch_s / t
    straight = solve(profile, cluster, "1f1b", m, straight=True)
    row["straight_ratio"] = straight.predicted.time_per_minibatch_s / t
    return row


def markdown(doc: dict[str, Any]) -> str:
    names = [*BASELINES, "straight"]
    out = [
        "# Synchronous-schedule benchmark (1F1B)",
        "",
        f"`{doc['command']}` on {doc['machine']}. 1F1B with {doc['microbatches']} microbatches per",
        "minibatch, flat clusters at 1e9 B/s, sgd, no memory limit. *optimal*: the branch and bound",
        "finished over every downset. Ratios are baseline time / chosen time (higher = the chosen plan",
        "is faster): data parallelism, DeepSpeed's parameter and uniform partitioning, torchgpipe's",
        "balance_by_time, and the best plan without replication (`--straight`). Solve time: one run.",
        "",
        "| profile | GPUs | ms/minibatch | solve s (cpu) | optimal | replicas | " + " | ".join(names) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(names),
    ]
    for r in doc["cases"]:
        reps = ",".join(map(str, r["replicas"]))
        ratios = " | ".join(f"{r[f'{n}_ratio']:.2f}" for n in names)
        out.append(
            f"| {r['profile']} | {r['gpus']} | {1e3 * r['time_per_minibatch_s']:.3f} | "
            f"{r['solve_time_s']:.3f} ({r['solve_cpu_s']:.3f}) | {'yes' if r['optimal'] else 'no'} | "
            f"{reps if len(reps) <= 30 else reps[:27] + '...'} | {ratios} |"
        )
    s = doc["summary"]
    out += [
        "",
        f"Cases: {s['cases']}; proven optimal: {s['optimal']}; slowest solve: {s['slowest']}.",
        "Geometric mean speedup of the chosen plan over "
        + ", ".join(f"{n} {s['geomean'][n]:.2f}x (worst {s['worst'][n]:.2f}x)" for n in names)
        + ".",
        "",
    ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    profile_args(parser)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    cases = []
    for name, profile in selected_profiles(args):
        for gpus in (4, 8, 16):
            row = {"profile": name, **run_case(profile, gpus, args.microbatches)}
            print(f"{name:14s} {gpus:3d} {1e3 * row['time_per_minibatch_s']:9.3f} ms "
                  f"{row['solve_cpu_s']:7.3f} s optimal={row['optimal']}", flush=True)  # fmt: skip
            cases.append(row)
    names = [*BASELINES, "straight"]
    slowest = max(cases, key=lambda c: c["solve_cpu_s"]) if cases else None
    doc = {
        "command": "python benchmarks/bench_sync.py"
        + (f" --only {args.only}" if args.only else "")
        + (f" --microbatches {args.microbatches}" if args.microbatches != 8 else ""),
        "machine": f"{platform.machine()} {platform.python_version()} (CPU, shared)",
        "microbatches": args.microbatches,
        "cases": cases,
        "summary": {
            "cases": len(cases),
            "optimal": sum(bool(c["optimal"]) for c in cases),
            "slowest": f"{slowest['profile']} {slowest['gpus']} {slowest['solve_cpu_s']:.2f} s cpu"
            if slowest
            else "",
            "geomean": {n: float(np.exp(np.mean(np.log([c[f"{n}_ratio"] for c in cases])))) for n in names}
            if cases
            else {},
            "worst": {n: min(c[f"{n}_ratio"] for c in cases) for n in names} if cases else {},
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_text_atomic(RESULTS / "bench_sync.json", json.dumps(doc, indent=1) + "\n")
    write_text_atomic(RESULTS / "bench_sync.md", markdown(doc))


if __name__ == "__main__":
    main()
