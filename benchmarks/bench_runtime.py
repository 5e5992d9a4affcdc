"""pipeplan's runtime (1f1b) against torch.distributed.pipelining's Schedule1F1B, and measured against
predicted time per minibatch.

Both runtimes train the SAME two stage modules (the stages of one package, built by ``pkg.stage(k)``)
on the same microbatches, with 2 gloo ranks on this CPU, their processes set up, fed and timed alike
(benchmarks/peers.py: the same allocator setting and threads, data, loss scaling and step clock).
Each round runs the two back to back, alternating which goes first; the headline is the median of
the rounds' ratios (each round: the median step after warm-up steps, the slower rank per step),
because this machine is shared.

The prediction is this script's own, not the partitioner's, and it models what the partitioner's
cost model models for 1f1b (partitioner/optimizer/pricing/schedules.py), plus the optimizer step and the data:

    predicted = sum_k t_k + (M - 1) max_k t_k          fill and drain, then the slowest stage paces
              + rtt(activation down, gradient up)       per cut: the first microbatch's activation and
                                                        the last one's gradient are on the critical path
              + max_k (S_k - sum_{j<k} t_j)             the optimizer step after the flush (stage 0's
                                                        is exposed; a later stage's hides behind the drain)
              + data                                    first stage's inputs, last stage's targets

with t_k = forward + backward of stage k on one microbatch (loss included on the last stage,
gradients accumulated as the runtime does) and S_k its optimizer step with ``zero_grad``. Every term
is measured in probe jobs just before and just after each round's runs (their mean is the round's
prediction): two processes set up like the ranks (the runtime's own ``share_cores`` and
``keep_freed_memory``, so the same threads per rank), both computing their stage at once for a fixed
time, as in the pipeline's steady state, then a gloo ping-pong of the real activation and gradient
shapes. No term is fitted to the measured times. The
first probe's prediction is written into the package's plan.json before pipeplan runs, for its own
metrics.json.

Run:  .venv/bin/python benchmarks/bench_runtime.py   (writes benchmarks/results/bench_runtime.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.peers import ALIKE, elastic, median_ratio, round_order, run_pipeplan, run_torch
from benchmarks.reporting import machine, write_results
from runtime.datasets.minibatches import SyntheticBatches
from runtime.job.worker import keep_freed_memory, share_cores
from runtime.packages.load import import_package

RESULTS = Path(__file__).resolve().parent / "results"

_INIT = '''"""Benchmark package: an MLP of {layers} Linear+ReLU layers of width {width}, cut into 2 stages."""
import torch
from torch import nn

WIDTH, LAYERS, CLASSES = {width}, {layers}, 10


class Part(nn.Module):
    def __init__(self, first, last):
        super().__init__()
        pairs = [(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(first, last)]
        self.layers = nn.Sequential(*[m for pair in pairs for m in pair])
        self.head = nn.Linear(WIDTH, CLASSES) if last == LAYERS else None

    def forward(self, x):
        x = self.layers(x)
        return self.head(x) if self.head is not None else x


def full_model(seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList([Part(0, LAYERS // 2), Part(LAYERS // 2, LAYERS)])


def stage(k, seed=0, device="cpu"):
    return full_model(seed)[k].to(device)


def arch():
    return "bench-mlp"


def model(criterion):
    parts = full_model()
    return [(parts[0], ["x"], ["h"]), (parts[1], ["h"], ["logits"]), (criterion, ["logits"], ["loss"])]


def criterion():
    return nn.CrossEntropyLoss()


def example_inputs(batch_size):
    return {{"x": torch.randn(batch_size, WIDTH)}}


def example_targets(batch_size):
    return torch.randint(0, CLASSES, (batch_size,))
'''


def write_package(folder: Path, width: int, layers: int, batch: int, micro: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text(_INIT.format(width=width, layers=layers))
    (folder / "mp_conf.json").write_text(
        json.dumps({"module_to_stage_map": [0, 1, 1], "stage_to_rank_map": {"0": [0], "1": [1]}})
    )
    set_prediction(folder, batch, micro, width, None)
    return folder


def set_prediction(folder: Path, batch: int, micro: int, width: int, predicted: float | None) -> None:
    """plan.json with this script's prediction (pipeplan's metrics.json compares against it)."""
    plan = {
        "schema": "pipeplan.plan/1",
        "gpus": 2,
        "cluster": {"levels": [{"devices": 2, "bandwidth": 1e9}]},
        "schedule": "1f1b",
        "microbatches": micro,
        "batch_size": batch,
        "stages": [{"index": k, "nodes": [], "replicas": 1, "ranks": [k]} for k in range(2)],
        "predicted": {"time_per_minibatch_s": 0.0 if predicted is None else predicted},
        "solver": {"name": "written by hand (this script's prediction)"},
        "extra": {"inputs": [{"name": "x", "shape": [batch, width], "dtype": "float32"}]},
    }
    (folder / "plan.json").write_text(json.dumps(plan, indent=1))


# ----------------------------------------------------------------------------- the probe
def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) if samples else 0.0


def _stage_loop(pkg: Any, rank: int, micro: int, m: int, seconds: float) -> dict[str, float]:
    """This rank's stage, M forward+backward then an optimizer step, over and over for ``seconds``;
    median wall and CPU seconds of each. Inputs and upstream gradients have the real shapes."""
    module = pkg.stage(rank)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    loss_fn, x, y = pkg.criterion(), pkg.example_inputs(micro)["x"], pkg.example_targets(micro)
    if rank == 1:
        x = pkg.stage(0)(x).detach()
    grad = torch.randn_like(module(x)) if rank == 0 else None
    times: dict[str, list[float]] = {k: [] for k in ("f", "b", "s", "f_cpu", "b_cpu", "s_cpu")}

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        out = fn()
        times[key].append(time.perf_counter() - start)
        times[key + "_cpu"].append(time.thread_time() - cpu)
        return out

    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(m):
            inp = x.clone().requires_grad_(rank > 0)
            out = timed("f", lambda: loss_fn(module(inp), y) / m if rank == 1 else module(inp))  # noqa: B023
            timed("b", lambda: out.backward(grad))  # noqa: B023
        timed("s", lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)))
    return {k: _median_ms(v[m:]) for k, v in times.items()}


def _pingpong(rank: int, shape: tuple[int, ...], repeats: int) -> float:
    """Median round trip over gloo: rank 0 sends an activation, rank 1 answers with its gradient."""
    import torch.distributed as dist

    buf, trips = torch.randn(shape), []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips[3:])


def _data_time(pkg: Any, rank: int, batch: int, repeats: int = 5) -> float:
    """The runtime's synthetic minibatch: inputs on the first stage, targets on the last."""
    data = SyntheticBatches(pkg, ["x"], batch, seed=0)
    fetch = data.inputs if rank == 0 else data.targets
    samples = []
    for step in range(repeats):
        start = time.perf_counter()
        fetch(step)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _probe_rank(package: str, batch: int, m: int, seconds: float) -> dict[str, Any]:
    """One rank of the probe: set up like a pipeplan CPU rank, then time every term of the model."""
    import torch.distributed as dist

    keep_freed_memory()
    share_cores()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    pkg, micro = import_package(package), batch // m
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "data": _data_time(pkg, rank, batch)}
    for turn in (0, 1):  # each stage alone (the other rank waits), the single-process view
        dist.barrier()
        if turn == rank:
            out["solo"] = _stage_loop(pkg, rank, micro, m, seconds / 2)
    dist.barrier()
    out["corun"] = _stage_loop(pkg, rank, micro, m, seconds)  # both at once, as in the pipeline
    dist.barrier()
    shape = tuple(pkg.stage(0)(pkg.example_inputs(micro)["x"]).shape)
    out["rtt"] = _pingpong(rank, shape, repeats=30)
    dist.barrier()
    dist.destroy_process_group()
    return out


def predict(probe: dict[int, dict[str, Any]], m: int, key: str = "corun") -> dict[str, float]:
    """The prediction's terms (seconds per minibatch) from one probe; see the module docstring."""
    stages = [probe[k][key] for k in sorted(probe)]
    t = [s["f"] + s["b"] for s in stages]
    terms = {
        "fill_drain_s": sum(t) - max(t),
        "steady_s": m * max(t),
        "comm_s": probe[0]["rtt"],
        "optimizer_step_s": max(s["s"] - sum(t[:k]) for k, s in enumerate(stages)),
        "data_s": probe[0]["data"] + probe[1]["data"],
    }
    terms["predicted_s"] = sum(terms.values())
    return terms


def probe(package: Path, batch: int, m: int, seconds: float) -> dict[int, dict[str, Any]]:
    return elastic(_probe_rank, str(package), batch, m, seconds)


def _mean_probe(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Term by term mean of two probes (numbers, and dicts of numbers, alike)."""

    def mean(x: Any, y: Any) -> Any:
        if isinstance(x, dict):
            return {k: mean(x[k], y[k]) for k in x}
        return x if x == y else (x + y) / 2

    return {k: mean(a[k], b[k]) for k in a}


# ----------------------------------------------------------------------------- the two runtimes
def _rank_summary(metrics: dict[str, Any]) -> list[dict[str, float]]:
    """Per rank, seconds per step of compute (wall and CPU), blocked receives and the rest."""
    out = []
    for r in metrics["ranks"]:
        n = len(r["step_times_s"])
        out.append(
            {
                "rank": r["rank"],
                "threads": r.get("threads", 0),
                "compute_s": r["compute_s"] / n,
                "compute_cpu_s": r.get("compute_cpu_s", 0.0) / n,
                "comm_s": r["comm_s"] / n,
                "idle_s": r["idle_s"] / n,
                "process_cpu_s": r.get("cpu_s", 0.0) / n,
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--probe-seconds", type=float, default=1.5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        b, m = args.batch_size, args.microbatches
        package = write_package(Path(tmp) / "pkg", args.width, args.layers, b, m)
        for r in range(args.repeats):
            before = probe(package, b, m, args.probe_seconds)
            set_prediction(package, b, m, args.width, predict(before, m)["predicted_s"])
            got: dict[str, Any] = {"load_1min": os.getloadavg()[0]}
            # Back to back, alternating which goes first, so a burst of load from other jobs hits both
            # alike; both set up, fed and timed alike (benchmarks/peers.py).
            for name in round_order([("pipeplan", "torch")], r):
                if name == "pipeplan":
                    ours, metrics = run_pipeplan(package, "1f1b", args.steps, m, args.warmup)
                    got["pipeplan"], got["pipeplan_ranks"] = ours["steps_s"], _rank_summary(metrics)
                else:
                    got["torch"] = run_torch(package, "1f1b", args.steps, m, args.warmup)["steps_s"]
            # Probes on both sides of the runs: the load of other jobs drifts within seconds here.
            got["probe"] = _mean_probe(before, probe(package, b, m, args.probe_seconds))
            got["terms"] = predict(got["probe"], m)
            rounds.append(got)
    report(args, rounds, (load_before, os.getloadavg()))


def _median_of(dicts: list[dict[str, float]], key: str) -> float:
    return statistics.median(d[key] for d in dicts)


def _stage_terms(rounds: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per stage, the median over rounds of each probe term (milliseconds)."""
    out = []
    for k in (0, 1):
        row = {"stage": float(k)}
        for view in ("solo", "corun"):
            for term in ("f", "b", "s", "f_cpu", "b_cpu"):
                row[f"{view}_{term}_ms"] = 1e3 * statistics.median(r["probe"][k][view][term] for r in rounds)
        row["data_ms"] = 1e3 * statistics.median(r["probe"][k]["data"] for r in rounds)
        out.append(row)
    return out


def report(
    args: argparse.Namespace,
    rounds: list[dict[str, Any]],
    load: tuple[tuple[float, ...], tuple[float, ...]],
) -> None:
    """Per round, the median step of each runtime run back to back and that round's prediction; each
    ratio is the median of the rounds' ratios (robust to load that changes between rounds)."""
    m = args.microbatches
    ours = [statistics.median(r["pipeplan"]) for r in rounds]
    theirs = [statistics.median(r["torch"]) for r in rounds]
    predicted = [r["terms"]["predicted_s"] for r in rounds]
    ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
    fidelity = [o / p for o, p in zip(ours, predicted, strict=True)]
    solo = [predict(r["probe"], m, "solo") for r in rounds]
    old = [s["fill_drain_s"] + s["steady_s"] for s in solo]  # the previous prediction: solo compute only
    terms = {k: _median_of([r["terms"] for r in rounds], k) for k in rounds[0]["terms"]}
    ranks = [
        {k: _median_of([r["pipeplan_ranks"][i] for r in rounds], k) for k in rounds[0]["pipeplan_ranks"][i]}
        for i in range(2)
    ]
    ratio, t_ours, t_theirs = median_ratio(ratios), statistics.median(ours), statistics.median(theirs)
    doc = {
        "benchmark": "bench_runtime",
        "setup": {**vars(args), "ranks": 2, "backend": "gloo",
                  "threads_per_rank": rounds[0]["probe"][0]["threads"]},
        "machine": machine(load, load_1min_per_round=[r["load_1min"] for r in rounds],
                           note="CPU shared with other jobs while measuring; rounds alternate the runtimes"),
        "pipeplan_1f1b_s_per_minibatch": t_ours,
        "torch_pipelining_1f1b_s_per_minibatch": t_theirs,
        "throughput_ratio_pipeplan_over_torch": ratio,
        "round_ratios": ratios,
        "predicted_s_per_minibatch_per_round": predicted,
        "measured_over_predicted_per_round": fidelity,
        "measured_over_predicted": statistics.median(fidelity),
        "prediction_source": "this script: probe of every term under the ranks' set-up (see docstring)",
        "prediction_terms_s_median": terms,
        "solo_compute_only_prediction_s_per_round": old,
        "measured_over_solo_compute_only": statistics.median(o / p for o, p in zip(ours, old, strict=True)),
        "stage_terms_ms_median": _stage_terms(rounds),
        "pipeplan_ranks_per_step_s_median": ranks,
        "rounds": rounds,
    }  # fmt: skip
    md = _markdown(args, doc, ours, theirs)
    write_results(RESULTS, "bench_runtime", doc, "\n".join(md))
    print("\n".join(md))


def _markdown(
    args: argparse.Namespace, doc: dict[str, Any], ours: list[float], theirs: list[float]
) -> list[str]:
    load, rounds = doc["machine"]["load_average_before_after"], doc["rounds"]
    ratio, fidelity = doc["throughput_ratio_pipeplan_over_torch"], doc["measured_over_predicted"]
    t_ours, t_theirs, terms = (
        doc["pipeplan_1f1b_s_per_minibatch"],
        doc["torch_pipelining_1f1b_s_per_minibatch"],
        doc["prediction_terms_s_median"],
    )
    names = {
        "fill_drain_s": "fill + drain: sum_k t_k - max_k t_k",
        "steady_s": "steady state: M max_k t_k",
        "comm_s": "exposed communication: gloo round trip (activation down, gradient up)",
        "optimizer_step_s": "optimizer step after the flush: max_k (S_k - sum_{j<k} t_j)",
        "data_s": "data: first stage's inputs + last stage's targets",
    }
    return [
        "# bench_runtime: pipeplan 1f1b vs torch.distributed.pipelining Schedule1F1B",
        "",
        f"MLP {args.layers} x {args.width}, batch {args.batch_size}, {args.microbatches} microbatches, "
        f"2 gloo ranks ({doc['setup']['threads_per_rank']} thread each) on a {os.cpu_count()}-core CPU "
        f"shared with other jobs (1-min load average {load[0][0]:.2f} before, {load[1][0]:.2f} after). "
        f"{len(rounds)} rounds: a probe of the prediction's terms, {args.steps} steps per runtime "
        f"({args.warmup} warm-up steps dropped), the runtimes back to back in alternating order; per round "
        "the median step (slower rank), then a second probe.",
        "",
        ALIKE,
        "",
        "| round | load 1 min | predicted s | pipeplan s | torch s | throughput ratio | measured/predicted |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {i} | {r['load_1min']:.2f} | {r['terms']['predicted_s']:.4f} | {o:.4f} | {t:.4f} "
            f"| {t / o:.3f} | {o / r['terms']['predicted_s']:.2f} |"
            for i, (r, o, t) in enumerate(zip(rounds, ours, theirs, strict=True))
        ),
        "",
        f"Throughput ratio pipeplan / torch (median of rounds): **{ratio:.3f}** (target >= 1.0); "
        f"pipeplan {args.batch_size / t_ours:.0f} samples/s, "
        f"torch {args.batch_size / t_theirs:.0f} samples/s.",
        "",
        f"Measured / predicted time per minibatch (median of rounds): **{fidelity:.2f}** "
        "(target within 20%). The old prediction (each stage timed alone, compute only) gives "
        f"{doc['measured_over_solo_compute_only']:.2f}.",
        "",
        "Prediction terms (median over rounds, seconds per minibatch; t_k = forward + backward of stage k "
        "on one microbatch, S_k its optimizer step, all measured with both ranks' processes running):",
        "",
        "| term | s | share |",
        "|---|---:|---:|",
        *(f"| {names[k]} | {terms[k]:.4f} | {terms[k] / terms['predicted_s']:.1%} |" for k in names),
        f"| **predicted** | **{terms['predicted_s']:.4f}** | |",
        "",
        "Stage terms (ms, median over rounds): alone (the other rank waiting) and co-run (both computing).",
        "",
        "| stage | F alone | B alone | F co-run | B co-run | F+B co-run CPU | S co-run | data |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {int(s['stage'])} | {s['solo_f_ms']:.2f} | {s['solo_b_ms']:.2f} | {s['corun_f_ms']:.2f} | "
            f"{s['corun_b_ms']:.2f} | {s['corun_f_cpu_ms'] + s['corun_b_cpu_ms']:.2f} | "
            f"{s['corun_s_ms']:.2f} | {s['data_ms']:.2f} |"
            for s in doc["stage_terms_ms_median"]
        ),
        "",
        "pipeplan's own per-rank metrics (seconds per step, median over rounds):",
        "",
        "| rank | compute | compute CPU | blocked in receives | rest | process CPU |",
        "|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {int(r['rank'])} | {r['compute_s']:.4f} | {r['compute_cpu_s']:.4f} | {r['comm_s']:.4f} | "
            f"{r['idle_s']:.4f} | {r['process_cpu_s']:.4f} |"
            for r in doc["pipeplan_ranks_per_step_s_median"]
        ),
        "",
    ]  # fmt: skip


if __name__ == "__main__":
    main()
