"""What does a CPU pipeline's message cost, and which probe finds it: idle ranks or busy ones?

``pipeplan probe`` times a gloo ping-pong between two local ranks, by default with each rank's
cores busy computing on the run's threads (a thread multiplying matrices), or with ``--idle`` ranks.
A run's own messages are the reference: ``pipeplan run --trace`` records when each sender's span
ended (the send is posted right after) and when each blocked receive ended, and a message whose
receiver was already waiting when it was posted is timed exactly (``partitioner.calibration.link_latency``,
what ``pipeplan calibrate --trace --cluster`` reads).

Each round, in alternating order, runs ``probe --idle`` and ``probe`` (2 ranks), then each model's
plan with ``--trace``: 1f1b with 4 microbatches, cut at half the profiled compute, one rank per
stage, profiled at the microbatch's size with one thread and the CPU clock (as bench_fidelity
does). Per round it records both probes' latency and bandwidth, each run's timed messages (median
wire time, and the latency they give at the busy probe's bandwidth), the share of a core the ranks
got, and the 1-minute load before each command.

Run:  .venv/bin/python -m benchmarks.bench_probe_load   (writes benchmarks/results/bench_probe_load.{json,md};
``--results NAME``: NAME.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_fidelity import Cli, Model, cut_layers, profile
from partitioner.calibration.link_latency import measure_links
from runtime.observing.metrics import cpu_share

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, run as a script
from benchmarks.reporting import write_results

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = (Model("vgg16", 8, "3,64,64"), Model("hf:llama", 8, "128"))
MICROBATCHES = 4


def probed(cli: Cli, idle: bool, name: str) -> dict[str, Any]:
    """``pipeplan probe`` (2 ranks, idle or busy): its level-0 link and how it was measured."""
    load = cli("probe", "--gpus", "2", "--device", "cpu", *(["--idle"] if idle else []), "-o", name)
    doc = json.loads((cli.folder / name).read_text())
    link = doc["probe"]["links"][0]
    return {
        "cores": doc["probe"]["cores"],
        "latency_s": link["latency_s"],
        "latency_rounds_s": link["latency_rounds_s"],
        "bandwidth": link["bandwidth"],
        "core_share": doc["probe"].get("core_share"),
        "load_1min": load,
    }


def package(cli: Cli, model: Model) -> str:
    """The model's 1f1b plan, cut at half its compute, one rank per stage; the package folder."""
    path, _ = profile(cli, model, repeats=3, micro=model.batch_size // MICROBATCHES)
    cut = cut_layers(json.loads((cli.folder / path).read_text()), (0.5,))
    out = f"plans/{model.spec.replace(':', '-')}"
    cli("partition", "--profile", str(path), "--gpus", "2", "--schedule", "1f1b",
        "--microbatches", str(MICROBATCHES), "--cuts", cut[0], "--replicas", "1,1", "-o", out)  # fmt: skip
    return str(next((cli.folder / out).glob("*/gpus=2")).relative_to(cli.folder))


def traced(cli: Cli, where: str, steps: int, cluster: str, name: str) -> dict[str, Any]:
    """Run the package with a trace; its timed messages against the busy probe's file."""
    load = cli("run", where, "--steps", str(steps), "--timeout", "300", "--no-checkpoint", "--trace", name)
    here = Path.cwd()
    os.chdir(cli.folder)  # plan.json names its profile from where partition ran
    try:
        done = measure_links(Path(where), name, cluster)  # (writes nothing)
    finally:
        os.chdir(here)
    metrics = json.loads((cli.folder / where / "run" / "metrics.json").read_text())
    return {
        "messages_timed": len(done.messages.seconds),
        "messages_skipped": done.messages.skipped,
        "wire_s_median": done.wire_median_s,
        "message_bytes_median": statistics.median(done.messages.nbytes),
        "latency_s": done.latency_s,
        "ranks_core_share": cpu_share(metrics),
        "time_per_minibatch_s": metrics["time_per_minibatch_s"],
        "load_1min": load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--results", default="bench_probe_load", help="Writes results/NAME.{json,md}.")
    args = parser.parse_args()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-probe-load-") as tmp:
        cli = Cli(Path(tmp))
        packages = {m.spec: package(cli, m) for m in MODELS}
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            probes = {
                ("idle" if idle else "busy"): probed(cli, idle, f"cluster-{r}-{idle}.json") for idle in order
            }
            busy_file = f"cluster-{r}-False.json"
            runs = {spec: traced(cli, where, args.steps, busy_file, f"trace-{r}-{i}.json")
                    for i, (spec, where) in enumerate(packages.items())}  # fmt: skip
            rounds.append({"round": r, "probe_order": ["idle" if o else "busy" for o in order],
                           "probes": probes, "runs": runs})  # fmt: skip
            print(json.dumps(rounds[-1]), flush=True)
    doc = {
        "benchmark": "bench_probe_load",
        "setup": {
            **vars(args),
            "models": [m.spec for m in MODELS],
            "schedule": "1f1b",
            "microbatches": MICROBATCHES,
        },
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "rounds": rounds,
    }
    write_results(RESULTS, args.results, doc, markdown(doc, args))
    print(markdown(doc, args))


def markdown(doc: dict[str, Any], args: argparse.Namespace) -> str:
    """One row per round: the probes' latencies beside what each model's run measured."""
    specs = doc["setup"]["models"]
    head = ["round", "load", "probe --idle us", "probe (busy) us", "busy core share"]
    head += [f"{s}: wire us (timed/skipped)" for s in specs]
    head += [f"{s}: latency us" for s in specs]
    lines = ["# A CPU pipeline's message: probe idle, probe busy, and the run's own", "",
             f"`python -m benchmarks.bench_probe_load --rounds {args.rounds} --steps {args.steps} "
             f"--results {args.results}` "
             f"({doc['machine']['cpu_count']} cores). Latency: probe's median one-way 16 B time; a run's: "
             "the median of its timed messages' wire time less bytes / the busy probe's bandwidth.", "",
             "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]  # fmt: skip
    for row in doc["rounds"]:
        idle, busy = row["probes"]["idle"], row["probes"]["busy"]
        loads = [idle["load_1min"], busy["load_1min"], *(run["load_1min"] for run in row["runs"].values())]
        cells = [str(row["round"]), f"{min(loads):.1f}-{max(loads):.1f}", f"{idle['latency_s'] * 1e6:.0f}",
                 f"{busy['latency_s'] * 1e6:.0f}", f"{busy['core_share']:.2f}"]  # fmt: skip
        runs = [row["runs"][s] for s in specs]
        cells += [
            f"{r['wire_s_median'] * 1e6:.0f} ({r['messages_timed']}/{r['messages_skipped']})" for r in runs
        ]
        cells += [f"{r['latency_s'] * 1e6:.0f}" for r in runs]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
