"""How long ``partition --schedule auto`` takes now that it searches 3D layouts too (issue 40, item 6),
each command run as a child process, as a user waits for it.

Per case: the wall time, the CPU time of the child (user + system: the figure other jobs' load does
not change; this machine is shared, so its wall time includes waiting for them), the 1-minute load
average before it, and the chosen plan, with the candidates the 3D search counted and searched.

- ``70b``: the README's example. ``pipeplan profile hf:benchmarks/configs/llama3-70b.json
  --device-model h100 --batch-size 64 --microbatch-size 1 --input-shape 4096 --dtype bfloat16``,
  then ``pipeplan partition --cluster dgx-h100:8 --optimizer adamw --schedule auto`` (target: 60 s
  wall). How the time grows: the same on 16 and 32 GPUs (``70b-16``, ``70b-32``: dgx-h100:2, :4).
- ``405b``: benchmarks/configs/llama3-405b.json (Llama-3.1-405B's shape), 512 sequences, on
  dgx-h100:64, 512 GPUs (target: 5 minutes).
- ``chain``: bench_optimizer.py's synthetic 1000-layer chain on 1024 GPUs (``partition --gpus 1024
  --bandwidth 1e10 --latency 0``: its ``Cluster.flat(1024, 1e10)``; pipedream, the default;
  target: 2 s).

    python benchmarks/bench_layouts.py [--sections 70b,405b,chain,70b-32,70b-16]

writes benchmarks/results/bench_layouts.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.child_runs import estimated_profile, pipeplan, timed  # noqa: E402
from benchmarks.reporting import RESULTS, table, write_results  # noqa: E402

#: case -> (model config, sequences a minibatch, dgx-h100 nodes of 8, target wall seconds)
CASES: dict[str, tuple[str, int, int, float]] = {
    "70b-16": ("llama3-70b.json", 64, 2, 0.0),
    "70b-32": ("llama3-70b.json", 64, 4, 0.0),
    "70b": ("llama3-70b.json", 64, 8, 60.0),
    "405b": ("llama3-405b.json", 512, 64, 300.0),
}

#: what the same commands took before (``/usr/bin/time`` around them, this checkout's commit 5add78c,
#: 2 Dec 2026, unless said otherwise)
BEFORE = {
    "70b": "73.1 s CPU, 73.1 s wall at load 0.9 (67.1 s CPU by hand at the 3D merge)",
    "405b": "258.3 s CPU, 258.4 s wall at load 1 (451.8 s CPU, 9:03 by hand before the runtime's rule)",
    "chain": "1.9 s CPU, 1.7 s wall at load 0.5 (issue 40 measured 3.4 s)",
}


NOTES = [
    "3D candidates: the (layout, microbatches a copy, schedule) searches, of those a bound on memory",
    "left, that a bound on time did not rule out. Where no layout beats the 2D plan (the 405B) the",
    "plan records none: the count is then the candidates' (`layouts._candidates`, in this process)",
    "whose bound is below the chosen plan's time, every one of which the search ran. The 70B on 16",
    "GPUs has no plan: AdamW's 16 bytes a parameter are 1.13 TB against 16 x 80 GiB = 1.37 TB.",
]


def bound_counts(profile: Path, nodes: int, time_s: float) -> dict[str, int]:
    """How many 3D candidates the search counts on ``dgx-h100:nodes`` and how many have a bound
    below ``time_s`` (what it searches when no layout beats the 2D plan)."""
    from partitioner.graph import load_profile
    from partitioner.optimizer import layouts
    from partitioner.partition import cluster_of
    from partitioner.profiler.update_cost import with_update_time

    prof = with_update_time(load_profile(profile), "adamw")
    cluster = cluster_of(None, None, None, None, f"dgx-h100:{nodes}", None, prof.device)
    found = [
        c
        for lay in layouts.layouts(prof, cluster)
        for c in layouts._candidates(prof, cluster, lay, "adamw", layouts.LAYOUT_SCHEDULES, None)
    ]
    return {"candidates": len(found), "searches": sum(c.bound < time_s for c in found)}


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def plan_summary(folder: Path) -> dict[str, Any]:
    """The chosen plan (the plan.json partition wrote under ``folder``) in a few fields."""
    found = list(folder.rglob("plan.json"))
    if not found:
        return {}
    doc = json.loads(found[0].read_text(encoding="utf-8"))
    stages, extra = doc.get("stages", []), doc.get("extra", {})
    layout = extra.get("layout") or {}
    shard = {"none": "", "optimizer": " zero1", "gradients": " zero2", "full": " fsdp"}
    name = (
        f"TP{layout['tensor_parallel']} x PP{len(stages)} x DP{layout['data_parallel']}"
        f"{shard.get(layout['shard'], '')}"
        if layout
        else f"PP{len(stages)} x DP {_span(sorted({s['replicas'] for s in stages}))}"
    )
    return {
        "layout": name, "schedule": doc.get("schedule"), "microbatches": doc.get("microbatches"),
        "time_per_minibatch_s": doc.get("predicted", {}).get("time_per_minibatch_s"),
        "recomputing": sum(bool(s.get("recompute")) for s in stages),
        "candidates": extra.get("candidates"), "searches": extra.get("searches"),
        "search_s": extra.get("search_s"), "schedule_auto": extra.get("schedule_auto"),
    }  # fmt: skip


def partition(profile: Path, cluster: list[str], folder: Path, auto: bool = True) -> dict[str, Any]:
    """``pipeplan partition`` of ``profile`` on ``cluster``, timed; the plan it chose."""
    out = folder / "out"
    command = [*pipeplan(), "partition", "--profile", str(profile), *cluster, "-o", str(out), "--force"]
    command += ["--optimizer", "adamw", "--schedule", "auto"] if auto else []
    run = timed(command, folder, check=False)
    tail = run.pop("tail")
    return {**run, "plan": plan_summary(out), **({"error": tail[-500:]} if run["rc"] else {})}


def chain_profile(path: Path) -> Path:
    """bench_optimizer's 1000-layer chain, written as a profile."""
    from benchmarks.bench_optimizer import synthetic_chain
    from partitioner.graph import save_profile

    path.parent.mkdir(parents=True, exist_ok=True)
    save_profile(synthetic_chain(), path)
    return path


def run(names: list[str], tmp: Path, load: float) -> list[dict[str, Any]]:
    """Every case asked, in order; a model's profile made once and shared by its cases. The results
    are written after each (a long run stopped keeps the cases it finished)."""
    rows: list[dict[str, Any]] = []
    profiles: dict[str, tuple[Path, dict[str, Any]]] = {}
    for name in names:
        if name == "chain":
            profile = chain_profile(tmp / "chain" / "profile.json")
            cluster = ["--gpus", "1024", "--bandwidth", "1e10", "--latency", "0"]
            row = {"case": name, "gpus": 1024, "target_s": 2.0, "profile": None,
                   "partition": partition(profile, cluster, tmp / "chain", auto=False)}  # fmt: skip
        else:
            config, batch, nodes, target = CASES[name]
            if config not in profiles:
                spec = HERE / "configs" / config
                profiles[config] = estimated_profile(spec, tmp / config / "profile.json", batch)
            profile, made = profiles[config]
            made = {k: v for k, v in made.items() if k != "tail"}
            folder = tmp / name
            folder.mkdir(parents=True, exist_ok=True)
            cluster = ["--cluster", f"dgx-h100:{nodes}"]
            row = {"case": name, "gpus": 8 * nodes, "target_s": target or None, "profile": made,
                   "partition": partition(profile, cluster, folder)}  # fmt: skip
            plan = row["partition"]["plan"]
            if plan and not plan.get("candidates"):
                plan.update(bound_counts(profile, nodes, plan["time_per_minibatch_s"]))
        row["before"] = BEFORE.get(name)
        rows.append(row)
        print(json.dumps(row), flush=True)
        loads = (load, os.getloadavg()[0])
        doc = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "load": loads},
               "rows": rows}  # fmt: skip
        write_results(RESULTS, "bench_layouts", doc, markdown(rows, loads))
    return rows


def markdown(rows: list[dict[str, Any]], load: tuple[float, float]) -> list[str]:
    lines = [
        "# partition --schedule auto with 3D layouts: search times",
        "",
        "`nice -n 19 python benchmarks/bench_layouts.py`: each command a child process; CPU s is the",
        "child's user + system time (what other jobs' load does not change), wall includes waiting for",
        f"them on this shared {os.cpu_count()}-core machine (1-minute load average before each command;",
        f"{load[0]:.1f} before the run, {load[1]:.1f} after). The commands: below, and the docstring.",
        "",
    ]
    body = []
    for r in rows:
        pa, plan = r["partition"], r["partition"]["plan"]
        found = "searched {searches} of {candidates}".format(**plan) if plan.get("candidates") else "-"
        chosen = (
            f"{plan['layout']}, {plan['schedule']}, {plan['microbatches']} microbatches, "
            f"{plan['time_per_minibatch_s']:.3f} s"
            if plan
            else (pa.get("error") or f"rc {pa['rc']}").strip().splitlines()[-1]
        )
        goal = r.get("target_s")
        met = "yes" if goal and pa["wall_s"] <= goal else "no"
        target = f"{goal:.0f} s wall: {met} (CPU: {'yes' if pa['cpu_s'] <= goal else 'no'})" if goal else "-"
        body.append((r["case"], r["gpus"], f"{pa['cpu_s']:.1f}", f"{pa['wall_s']:.1f}", pa["load_before"],
                     target, chosen, found, r.get("before") or "-"))  # fmt: skip
    head = ("case", "GPUs", "partition CPU s", "wall s", "load", "target met", "chosen plan",
            "3D candidates", "before")  # fmt: skip
    lines += table(head, body, "lrrrrllll")
    lines += ["", *NOTES]
    made = {r["profile"]["command"]: r["profile"] for r in rows if r.get("profile")}
    lines += ["", "Profiles (made once per model):", ""]
    lines += [f"- `{cmd}`: {p['cpu_s']:.1f} s CPU, {p['wall_s']:.1f} s wall" for cmd, p in made.items()]
    lines += ["", "Partition commands:", ""]
    lines += [f"- {r['case']}: `{r['partition']['command']}`" for r in rows]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sections", default="70b,405b,chain,70b-32,70b-16")
    names = parser.parse_args().sections.split(",")
    unknown = [n for n in names if n not in CASES and n != "chain"]
    if unknown:
        parser.error(f"unknown sections: {', '.join(unknown)}")
    with tempfile.TemporaryDirectory() as tmp:
        run(names, Path(tmp), os.getloadavg()[0])


if __name__ == "__main__":
    main()
