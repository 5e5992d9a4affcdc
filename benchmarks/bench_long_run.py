"""A run's start-up and memory do not depend on --steps: ``pipeplan run --steps 1000000`` against
``--steps 10`` on tiny-mlp, 2 ranks, pipedream and 1f1b.

The whole command is timed, as a user waits for it: from starting ``pipeplan run`` to its first
progress line (step 1, ``run/progress.jsonl``). Each rank's peak resident memory (``VmHWM`` of the
rank processes, read every 10 ms) is taken when step ``--upto`` is reached, or at the last reading
before the 10-step run ends; the long run is then stopped (SIGINT to its process group). The two
step counts alternate, ``--rounds`` times, and the load average is recorded with each run: this
machine is shared.

    .venv/bin/python benchmarks/bench_long_run.py [--rounds 3] [--name NAME]

Writes benchmarks/results/NAME.{json,md} (default bench_long_run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, run as a script
from benchmarks.reporting import write_results

RESULTS = Path(__file__).resolve().parent / "results"
SOURCE = Path(__file__).resolve().parents[1]
STEPS = (10, 1_000_000)
SCHEDULES = ("pipedream", "1f1b")


def _cli(source: Path) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(source)!r}); import cli; cli.main()"]


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _rank_peaks(pid: int) -> list[int]:
    """VmHWM (bytes) of every rank process below ``pid``: the elastic launcher starts a function
    entrypoint through multiprocessing (a fork server, or spawn) and sets the rank's environment
    inside it, so a rank is a child of the fork server or a spawned interpreter, not a process with
    ``LOCAL_RANK`` in its environment."""
    ranks, todo = [], [pid]
    while todo:
        p = todo.pop()
        server = b"forkserver" in _cmdline(p)
        for child in _children(p):
            todo.append(child)
            if server or b"spawn_main" in _cmdline(child):
                ranks.append(child)
    peaks = []
    for rank in ranks:
        try:
            status = Path(f"/proc/{rank}/status").read_text()
        except OSError:
            continue
        peaks += [int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")]
    return peaks


def _last_step(progress: Path) -> int:
    try:
        lines = progress.read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(line).get("step", 0) for line in lines[-3:] if line.strip()]
    return max(steps, default=0)


def run_once(source: Path, package: Path, steps: int, upto: int) -> dict[str, Any]:
    """One ``pipeplan run``: seconds to step 1, the ranks' peak memory by step ``upto``."""
    progress = package / "run" / "progress.jsonl"
    progress.unlink(missing_ok=True)
    load = os.getloadavg()[0]
    began = time.perf_counter()
    proc = subprocess.Popen(
        [*_cli(source), "run", str(package), "--steps", str(steps), "--timeout", "60"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(source)},
    )  # fmt: skip
    first, peaks = None, []
    while proc.poll() is None:
        seen = _rank_peaks(proc.pid) or peaks
        peaks = seen if len(seen) >= len(peaks) else peaks
        step = _last_step(progress)
        if first is None and step >= 1:
            first = time.perf_counter() - began
        if step >= upto and steps > upto:
            os.killpg(proc.pid, signal.SIGINT)
            break
        time.sleep(0.01)
    proc.wait(timeout=120)
    if first is None and _last_step(progress) >= 1:  # (the run ended between two readings)
        first = time.perf_counter() - began
    return {"steps": steps, "first_step_s": first, "rank_peak_bytes": max(peaks, default=None),
            "ranks_seen": len(peaks), "loadavg_1min": load}  # fmt: skip


def _package(source: Path, root: Path, schedule: str) -> Path:
    cli = _cli(source)
    profile = root / "profile.json"
    if not profile.exists():
        subprocess.run([*cli, "profile", "tiny-mlp", "--batch-size", "8", "--threads", "1", "--no-fixed-cost",
                        "-o", str(profile)], check=True, capture_output=True)  # fmt: skip
    out = root / schedule
    subprocess.run([*cli, "partition", "--profile", str(profile), "--gpus", "2", "--schedule", schedule,
                    "--host-cores", "0", "-o", str(out)], check=True, capture_output=True)  # fmt: skip
    return next(out.glob("*/gpus=2"))


def markdown(doc: dict[str, Any]) -> str:
    out = [
        f"# {doc['name']}",
        "",
        f"`{doc['command']}` on {doc['machine']}: tiny-mlp on 2 ranks, `pipeplan run --steps N`, the whole",
        "command timed from its start to its first progress line; each rank's peak resident memory",
        f"(VmHWM) by step {doc['upto']}. Runs alternate between the step counts; median over the rounds.",
        "",
        "| schedule | --steps | first step s (median, each) | rank peak MiB (median) | load (1 min) |",
        "|---|---|---|---|---|",
    ]
    for row in doc["rows"]:
        each = ", ".join(f"{s:.2f}" for s in row["first_step_s"])
        out.append(
            f"| {row['schedule']} | {row['steps']:,} | {row['median_first_step_s']:.2f} ({each}) | "
            f"{row['median_rank_peak_bytes'] / 2**20:.1f} | "
            + ", ".join(f"{x:.1f}" for x in row["loadavg_1min"])
            + " |"
        )
    return "\n".join([*out, ""])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--upto", type=int, default=10, help="the step at which memory is read")
    parser.add_argument("--name", default="bench_long_run")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in SCHEDULES:
            package = _package(SOURCE, Path(tmp), schedule)
            runs: dict[int, list[dict[str, Any]]] = {s: [] for s in STEPS}
            for _ in range(args.rounds):
                for steps in STEPS:
                    runs[steps].append(run_once(SOURCE, package, steps, args.upto))
                    print(schedule, runs[steps][-1], flush=True)
            for steps, done in runs.items():
                firsts = [r["first_step_s"] for r in done if r["first_step_s"] is not None]
                peaks = [r["rank_peak_bytes"] for r in done if r["rank_peak_bytes"]]
                rows.append({"schedule": schedule, "steps": steps, "first_step_s": firsts,
                             "median_first_step_s": statistics.median(firsts) if firsts else float("nan"),
                             "rank_peak_bytes": peaks,
                             "median_rank_peak_bytes": statistics.median(peaks) if peaks else float("nan"),
                             "loadavg_1min": [r["loadavg_1min"] for r in done]})  # fmt: skip
    named = f" --name {args.name}" if args.name != "bench_long_run" else ""
    flags = f" --rounds {args.rounds}{named}"
    machine = f"{platform.machine()} {platform.python_version()} (CPU, shared)"
    command = f"python benchmarks/bench_long_run.py{flags}"
    doc = {"name": args.name, "command": command, "upto": args.upto, "machine": machine, "rows": rows}
    write_results(RESULTS, args.name, doc, markdown(doc))


if __name__ == "__main__":
    main()
