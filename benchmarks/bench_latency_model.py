"""What the per-message latency changes in the predictions bench_interleaved compared with its runs.

bench_interleaved ran an MLP (8 x 1024, batch 128, 4 microbatches) on 2 local gloo ranks under
interleaved 1F1B (4 stages, 2 a rank) and 1F1B (2 stages), measured each stage's forward and backward
alone, and reported the measured time and bubble beside the cost model's. This prices the same
stages again (the measured stage times as the profile, activations 4 bytes x 1024 x the microbatch)
with the link's latency at 0, as the model had it, and at the one-way latency bench_gloo_latency
measured for a 16-byte message; by the closed form and by the simulation of the runtime's lists.
Deterministic (no timing, no torch): it reads results/bench_interleaved.json and
results/bench_gloo_latency.json.

Run:  .venv/bin/python benchmarks/bench_latency_model.py
(writes benchmarks/results/bench_latency_model.{json,md})
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from partitioner.graph import Node, Profile
from partitioner.optimizer import evaluate
from partitioner.optimizer.pricing.simulate import simulate
from partitioner.plan import Cluster, Link

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, run as a script
from benchmarks.reporting import write_results

RESULTS = Path(__file__).resolve().parent / "results"
BANDWIDTH = 1e9  # partition's default, as bench_interleaved priced it


def _profile(run: dict[str, Any]) -> Profile:
    """Four layers with the measured per-microbatch stage times (x M: a profile is per minibatch)."""
    m, width, batch = run["config"]["microbatches"], run["config"]["width"], run["config"]["batch_size"]
    out = 4 * width * batch  # float32 activations of one minibatch
    nodes = [Node("x", "x", "input", "Input", output_bytes=out)]
    pairs = zip(run["stage_forward_s_per_microbatch"], run["stage_backward_s_per_microbatch"], strict=True)
    for i, (f, b) in enumerate(pairs):
        inputs = (f"l{i - 1}",) if i else ("x",)
        fwd_ms, bwd_ms = f * m * 1e3, b * m * 1e3
        nodes.append(Node(f"l{i}", f"stage{i}", "call_module", "Linear", inputs, fwd_ms, bwd_ms, out, out, 0))
    return Profile(tuple(nodes), model="bench_interleaved-mlp", batch_size=batch, device="cpu")


def main() -> None:
    run = json.loads((RESULTS / "bench_interleaved.json").read_text())
    gloo = json.loads((RESULTS / "bench_gloo_latency.json").read_text())
    latency = next(r["one_way_s"] for r in gloo["rows"] if r["bytes"] == 16)
    profile, m = _profile(run), run["config"]["microbatches"]
    layouts = {"pipeplan interleaved": ("interleaved", ["l0", "l1", "l2"]), "pipeplan 1f1b": ("1f1b", ["l1"])}
    rows = []
    for name, (schedule, cuts) in layouts.items():
        measured = run["results"][name]
        for alpha in (0.0, latency):
            extra = {"virtual_stages": 2} if schedule == "interleaved" else {}
            cluster = Cluster.flat(2, Link(BANDWIDTH, alpha))
            plan = evaluate(profile, cluster, cuts, [1] * (len(cuts) + 1), schedule, m, **extra)
            sim = simulate(plan, profile)
            closed = plan.predicted
            rows.append({
                "run": name, "latency_s": alpha,
                "closed_form_s": closed.time_per_minibatch_s, "closed_form_bubble": closed.bubble_fraction,
                "simulated_s": sim.time_per_minibatch_s, "simulated_bubble": sim.bubble_fraction,
                "measured_s": measured["s_per_minibatch"], "measured_bubble": measured["measured_bubble"],
            })  # fmt: skip
    doc = {"benchmark": "bench_latency_model", "latency_source": "bench_gloo_latency, 16 B one-way median",
           "measured_load_1min": run["load_1min_before_after"], "rows": rows}  # fmt: skip
    md = [
        "# The per-message latency in bench_interleaved's predictions",
        "",
        "`python benchmarks/bench_latency_model.py`: bench_interleaved's measured stage times priced "
        f"again, the latency 0 (as before) and {latency * 1e3:.2f} ms (bench_gloo_latency, 16 B one way); "
        f"the measured columns are bench_interleaved's runs (load {run['load_1min_before_after'][0]:.1f}).",
        "",
        "| run | latency ms | closed form ms | bubble | simulation ms | bubble | measured ms | bubble |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [r["run"], f"{r['latency_s'] * 1e3:.2f}"]
        for key in ("closed_form", "simulated", "measured"):
            cells += [f"{r[key + '_s'] * 1e3:.1f}", f"{r[key + '_bubble']:.2f}"]
        md.append("| " + " | ".join(cells) + " |")
    md += [
        "",
        "Interleaved is priced by the simulation (its closed form is the search's bound). 1F1B's closed "
        "form charges each microbatch's messages on its stage, the simulation as delays the fill and drain "
        "wait on; the runtime sends asynchronously (isend), closer to the simulation.",
    ]
    write_results(RESULTS, "bench_latency_model", doc, md)
    print("\n".join(md))


if __name__ == "__main__":
    main()
