"""How long ``partition --schedule auto`` takes now that it searches 3D layouts too (issue 40, item 6).

Each row runs the real commands as child processes, as a user waits for them: ``pipeplan profile``
(estimated for the h100 preset, 4096 tokens, bf16) and then ``pipeplan partition --cluster
dgx-h100:N --optimizer adamw --schedule auto`` (every schedule, microbatch count and recomputation
of the 2D search, then every 3D layout that its bound does not rule out), recording the wall time,
the CPU time of the child (user + system), the load average before it (this machine is shared:
wall time includes waiting for other jobs), and the chosen plan.

- ``70b``: benchmarks/configs/llama3-70b.json, 64 sequences, on 8 nodes of 8 (target: 60 s);
- ``405b``: benchmarks/configs/llama3-405b.json (Llama-3.1-405B's shape), 512 sequences, on 64
  nodes of 8 (target: 5 minutes).

    python benchmarks/bench_layouts.py [--sections 70b,405b]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

CASES = {
    "70b": ("llama3-70b.json", 64, 8),
    "405b": ("llama3-405b.json", 512, 64),
}


def _pipeplan() -> str:
    here = Path(sys.executable).parent / "pipeplan"
    return str(here) if here.exists() else (shutil.which("pipeplan") or "pipeplan")


def timed(command: list[str], cwd: Path) -> dict[str, object]:
    """Run ``command``; its wall and CPU seconds, the load before it, and its output's tail."""
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env={**os.environ})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"command": " ".join(command), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "load_before": round(load, 1), "rc": done.returncode,
            "tail": (done.stdout + done.stderr)[-3000:]}  # fmt: skip


def case(name: str) -> dict[str, object]:
    config, batch, nodes = CASES[name]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        profile = timed(
            [_pipeplan(), "profile", f"hf:{HERE / 'configs' / config}", "--device-model", "h100",
             "--batch-size", str(batch), "--microbatch-size", "1", "--input-shape", "4096",
             "--dtype", "bfloat16"], folder,
        )  # fmt: skip
        found = next(folder.rglob("profile.json"))
        partition = timed(
            [_pipeplan(), "partition", "--profile", str(found), "--cluster", f"dgx-h100:{nodes}",
             "--optimizer", "adamw", "--schedule", "auto", "--json"], folder,
        )  # fmt: skip
        plan: dict[str, object] = {}
        if partition["rc"] == 0:
            plans = list(folder.rglob("plan.json"))
            doc = json.loads(plans[0].read_text()) if plans else {}
            stages = doc.get("stages", [])
            plan = {
                "schedule": doc.get("schedule"), "microbatches": doc.get("microbatches"),
                "stages": len(stages), "replicas": sorted({s["replicas"] for s in stages}),
                "tensor_parallel": stages[0].get("tensor_parallel", 1) if stages else None,
                "shard": stages[0].get("shard", "none") if stages else None,
                "time_per_minibatch_s": doc.get("predicted", {}).get("time_per_minibatch_s"),
                "searches": doc.get("extra", {}).get("searches"),
                "candidates": doc.get("extra", {}).get("candidates"),
            }  # fmt: skip
        partition.pop("tail")
        return {"case": name, "profile": {k: v for k, v in profile.items() if k != "tail"},
                "partition": partition, "plan": plan}  # fmt: skip


def markdown(rows: list[dict[str, object]]) -> str:
    lines = [
        "# partition --schedule auto with 3D layouts: search times",
        "",
        "`python benchmarks/bench_layouts.py`; wall and CPU seconds of the child process, the load",
        "average before it (a shared 2-core machine).",
        "",
        "| case | profile wall / CPU s | partition wall / CPU s | load | plan |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        pr, pa, plan = r["profile"], r["partition"], r["plan"]
        assert isinstance(pr, dict) and isinstance(pa, dict) and isinstance(plan, dict)
        lines.append(
            f"| {r['case']} | {pr['wall_s']} / {pr['cpu_s']} | {pa['wall_s']} / {pa['cpu_s']} | "
            f"{pa['load_before']} | {json.dumps(plan)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default="70b,405b")
    names = parser.parse_args().sections.split(",")
    rows = []
    for name in names:
        rows.append(case(name))
        print(json.dumps(rows[-1]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_layouts.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    (RESULTS / "bench_layouts.md").write_text(markdown(rows), encoding="utf-8")


if __name__ == "__main__":
    main()
