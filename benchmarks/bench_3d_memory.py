"""3D layouts' memory and step time against their price, on CPU ranks over gloo (issue 39).

    PYTHONPATH=. python benchmarks/bench_3d_memory.py [--only llama] [--no-memory] [--no-times]

The layouts of ``bench_3d.py`` (PP2 x TP2, PP2 x DP2 at every shard level, PP2 x DP2 x TP2
plain and fully sharded) of its three models, each cut in the middle of its layers as
``bench_3d.py`` cuts them, under 1f1b with 4 microbatches of a batch of 8 and Adam. Each plan is
priced by the planner (``evaluate_layout``: the 3D price, ``partitioner/optimizer/pricing``; the
replicated layout, which the runtime runs as a 2D plan, by the 2D ``evaluate``), written as a
package and run by ``pipeplan run --measure-memory``: per rank, plan.json's predicted peak
against the rank's measured peak of live tensor storages (``runtime/observing/peak_memory.py``).
Then the step times: the llama-shaped model's PP2 x TP2 and PP2 x DP2 at ``optimizer`` and
``full`` against the same stages replicated (PP2 x DP2), ``pipeplan run --steps`` beside
plan.json's predicted time, with the load and the ranks' share of a core (the machine is shared),
each layout run ``--repeats`` times in turn. Writes results/bench_3d_memory.{json,md} (memory, about
15 minutes on two shared cores) and results/bench_3d_times.{json,md} (times, about 4 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.reporting import RESULTS, machine, table, write_results

LAYOUTS: dict[str, tuple[int, int, str]] = {
    "PP2 x TP2": (2, 1, "none"),
    "PP2 x DP2 replicated": (1, 2, "none"),
    "PP2 x DP2 optimizer": (1, 2, "optimizer"),
    "PP2 x DP2 gradients": (1, 2, "gradients"),
    "PP2 x DP2 full": (1, 2, "full"),
    "PP2 x DP2 x TP2": (2, 2, "none"),
    "PP2 x DP2 x TP2 full": (2, 2, "full"),
}
TIMED = ("PP2 x DP2 replicated", "PP2 x TP2", "PP2 x DP2 optimizer", "PP2 x DP2 full")
MICROBATCHES, BATCH, OPTIMIZER = 4, 8, "adam"
WITHIN = 0.10


def _plan(profile: Any, layout: tuple[int, int, str]) -> Any:
    """The planner's price of ``layout`` on two stages cut in the middle (bench_3d's cut)."""
    from partitioner.optimizer.layouts import evaluate_layout
    from partitioner.optimizer.planner import evaluate
    from partitioner.optimizer.pricing.layout import Layout
    from partitioner.partition import cluster_of, cpu_hosts

    t, d, shard = layout
    ids = [n.id for n in profile.nodes]
    cut = [ids[round(len(ids) / 2) - 1]]
    cluster = cpu_hosts(cluster_of(2 * t * d, None, None, None), profile, None)
    if t == 1 and shard == "none":  # (the runtime runs it as a 2D plan: its 2D price)
        return evaluate(profile, cluster, cut, [d, d], "1f1b", MICROBATCHES, OPTIMIZER)
    return evaluate_layout(profile, cluster, Layout(t, d, shard), cut, "1f1b", MICROBATCHES // d, OPTIMIZER)


def _run(package: Path, *more: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "cli", "run", str(package), "--optimizer", OPTIMIZER, "--lr", "0.001",
           "--no-checkpoint", "--timeout", "300", *more]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    newest = sorted((package / "runs").glob("*/metrics.json"))[-1]
    return json.loads(newest.read_text())  # type: ignore[no-any-return]


def _memory_rows(model: str, name: str, plan: Any, metrics: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for r in sorted(metrics["ranks"], key=lambda r: r["rank"]):
        want, got = plan.stages[r["stage"]].memory_bytes, r["peak_memory_bytes"]
        rows.append({"model": model, "layout": name, "rank": r["rank"], "stage": r["stage"],
                     "predicted_bytes": want, "measured_bytes": got,
                     "ratio": got / want if got and want else None})  # fmt: skip
    return rows


def _time_row(name: str, plan: Any, metrics: dict[str, Any]) -> dict[str, Any]:
    from runtime.observing.metrics import cpu_share

    measured, predicted = metrics["time_per_minibatch_s"], plan.predicted.time_per_minibatch_s
    return {"layout": name, "ranks": metrics["world_size"], "steps": metrics["steps"],
            "measured_s": measured, "predicted_s": predicted,
            "ratio": measured / predicted if measured and predicted else None,
            "cpu_share": cpu_share(metrics), "load_1min": metrics["machine"]["loadavg_1min"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=None, help="models whose name contains this (memory)")
    parser.add_argument("--steps", type=int, default=10, help="steps of each timed run")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each layout")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-times", action="store_true")
    args = parser.parse_args()
    from partitioner.profiler import profile as profiler
    from tests.runtime.packages3d import bench_models

    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        specs = bench_models(tmp)
        wanted = [m for m in specs if not args.no_memory and (not args.only or args.only in m)]
        if not args.no_times and "hf:llama-shaped" not in wanted:
            wanted.append("hf:llama-shaped")
        profiles = {m: profiler.profile_model(specs[m], batch_size=BATCH, repeats=1) for m in wanted}
        if not args.no_memory:
            load = [os.getloadavg()[0]]
            memory = [row for m in wanted if not args.only or args.only in m
                      for row in _memory(tmp, m, profiles[m])]  # fmt: skip
            load.append(os.getloadavg()[0])
            doc = {"machine": machine(load), "memory": memory, "within": WITHIN}
            write_results(RESULTS, "bench_3d_memory", doc, _page(doc))
        if not args.no_times:
            load = [os.getloadavg()[0]]
            times = _times(tmp, profiles["hf:llama-shaped"], args.steps, args.repeats)
            load.append(os.getloadavg()[0])
            doc = {"machine": machine(load), "times": times}
            write_results(RESULTS, "bench_3d_times", doc, _times_page(doc))


def _package(tmp: Path, model: str, name: str, profile: Any) -> tuple[Any, Path]:
    from partitioner.generation import codegen

    plan = _plan(profile, LAYOUTS[name])
    package = tmp / f"{model}-{name}".replace(" ", "_").replace(":", "_")
    if not package.exists():
        codegen.write_package(profile, plan, package)
    return plan, package


def _memory(tmp: Path, model: str, profile: Any) -> list[dict[str, Any]]:
    out = []
    for name in LAYOUTS:
        plan, package = _package(tmp, model, name, profile)
        rows = _memory_rows(model, name, plan, _run(package, "--steps", "3", "--measure-memory"))
        print(json.dumps(rows), flush=True)
        out += rows
    return out


def _times(tmp: Path, profile: Any, steps: int, repeats: int) -> list[dict[str, Any]]:
    out = []
    for repeat in range(repeats):  # (in turn, so a burst of other work does not fall on one layout)
        for name in TIMED:
            plan, package = _package(tmp, "hf:llama-shaped", name, profile)
            out.append({**_time_row(name, plan, _run(package, "--steps", str(steps))), "repeat": repeat})
            print(json.dumps(out[-1]), flush=True)
    return out


def _page(doc: dict[str, Any]) -> list[str]:
    mib = 2**20
    held = [r for r in doc["memory"] if r["ratio"] is not None]
    inside = sum(abs(r["ratio"] - 1) <= WITHIN for r in held)
    load = doc["machine"]["load_average_before_after"]
    lines = [
        "# 3D layouts: measured memory against the plan (benchmarks/bench_3d_memory.py)",
        "",
        "`PYTHONPATH=. python benchmarks/bench_3d_memory.py`: gloo, CPU ranks, 1f1b, 4 microbatches of",
        "a batch of 8, Adam, two stages cut in the middle of the layers (bench_3d.py's cut). Predicted:",
        "plan.json's peak per device (the 3D price, `partitioner/optimizer/pricing/`; the replicated",
        "layout's is the 2D price, as the runtime runs it as a 2D plan); measured: `pipeplan run",
        "--steps 3 --measure-memory`, the rank's peak of live tensor storages (every operator's",
        "outputs; not an operator's scratch, nor gloo's own buffers).",
        f"{inside} of {len(held)} ranks within {WITHIN:.0%}. 1-minute load {load[0]:.1f} before and "
        f"{load[1]:.1f} after on {doc['machine']['cpu_count']} cores (the counts do not depend on it).",
        "",
        *table(["model", "layout", "rank", "stage", "predicted MiB", "measured MiB", "measured/predicted"],
               [[r["model"], r["layout"], r["rank"], r["stage"], f"{r['predicted_bytes'] / mib:.2f}",
                 f"{r['measured_bytes'] / mib:.2f}" if r["measured_bytes"] else "",
                 f"{r['ratio']:.3f}" if r["ratio"] else ""] for r in doc["memory"]], "lllrrrr"),
    ]  # fmt: skip
    outside = sorted({(r["model"], r["layout"], r["stage"]) for r in held if abs(r["ratio"] - 1) > WITHIN})
    if outside:
        where = "; ".join(f"{m} {lay} stage {k}" for m, lay, k in outside)
        lines += ["", f"Outside 10%: {where}."]
    return lines


def _times_page(doc: dict[str, Any]) -> list[str]:
    load = doc["machine"]["load_average_before_after"]
    return [
        "# 3D layouts: step time against the plan, llama-shaped, 4 CPU ranks (benchmarks/bench_3d_memory.py)",
        "",
        "`PYTHONPATH=. python benchmarks/bench_3d_memory.py --no-memory`: `pipeplan run --steps N` (the",
        "median step after the first, metrics.json) beside plan.json's predicted time, 1f1b, 4",
        "microbatches of a batch of 8, Adam, each layout run in turn. The machine is shared (other",
        f"engineers' jobs): 1-minute load {load[0]:.1f} before and {load[1]:.1f} after on",
        f"{doc['machine']['cpu_count']} cores; 4 ranks share 2 cores; cpu share: the ranks' CPU over wall",
        "seconds while computing (below 1: they waited for a core), load: at the run's end.",
        "",
        *table(["layout", "repeat", "ranks", "steps", "measured s/minibatch", "predicted s/minibatch",
                "measured/predicted", "cpu share", "load (1 min)"],
               [[t["layout"], t["repeat"], t["ranks"], t["steps"], f"{t['measured_s']:.3f}",
                 f"{t['predicted_s']:.3f}", f"{t['ratio']:.2f}",
                 f"{t['cpu_share']:.2f}" if t["cpu_share"] else "", f"{t['load_1min']:.1f}"]
                for t in doc["times"]], "lrrrrrrrr"),
    ]  # fmt: skip


if __name__ == "__main__":
    main()
