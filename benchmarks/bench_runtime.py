"""pipeplan's runtime (1f1b) against torch.distributed.pipelining's Schedule1F1B, and measured against
predicted time per minibatch.

Both runtimes train the SAME two stage modules (the stages of one package, built by ``pkg.stage(k)``)
on the same microbatches, with 2 gloo ranks on this CPU, 1 thread per rank, launched the same way
(torch's elastic launch, fork). Runs alternate between the two and repeat, and the median step time
(after warm-up steps, the slower rank per step) is kept, because this machine is shared.

The prediction written into the package's plan.json comes from this script, not from the
partitioner: it times each stage's forward+backward on one microbatch in this process (1 thread)
and applies the 1F1B formula  sum_k t_k + (M - 1) * max_k t_k  (fill, then the slowest stage paces
the rest; communication not modelled).

Run:  .venv/bin/python benchmarks/bench_runtime.py   (writes benchmarks/results/bench_runtime.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from runtime.launch import free_port, launch
from runtime.options import RunOptions
from runtime.package import import_package

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


def stage_times(pkg: Any, micro: int, repeats: int = 7) -> list[float]:
    """Median forward+backward seconds of each stage on one microbatch, one thread."""
    torch.set_num_threads(1)
    times = []
    x = pkg.example_inputs(micro)["x"]
    loss_fn = pkg.criterion()
    y = pkg.example_targets(micro)
    for k in range(2):
        module = pkg.stage(k)
        samples = []
        for _ in range(repeats):
            inp = x.clone().requires_grad_(k > 0)
            start = time.perf_counter()
            out = module(inp)
            (loss_fn(out, y) if k == 1 else out.sum()).backward()
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
        x = module(x).detach()
    return times


def write_package(
    folder: Path, width: int, layers: int, batch: int, micro: int
) -> tuple[Path, dict[str, Any]]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text(_INIT.format(width=width, layers=layers))
    (folder / "mp_conf.json").write_text(
        json.dumps({"module_to_stage_map": [0, 1, 1], "stage_to_rank_map": {"0": [0], "1": [1]}})
    )
    t = stage_times(import_package(folder), batch // micro)
    predicted = sum(t) + (micro - 1) * max(t)
    plan = {
        "schema": "pipeplan.plan/1",
        "gpus": 2,
        "schedule": "1f1b",
        "microbatches": micro,
        "batch_size": batch,
        "stages": [{"index": k, "replicas": 1, "ranks": [k]} for k in range(2)],
        "predicted": {"time_per_minibatch_s": predicted},
        "extra": {"inputs": [{"name": "x", "shape": [batch, width], "dtype": "float32"}]},
    }
    (folder / "plan.json").write_text(json.dumps(plan, indent=1))
    return folder, {"stage_fwd_bwd_s": t, "predicted_s": predicted}


def _pipelining_rank(package: str, steps: int, micro: int, batch: int) -> list[float]:
    """One rank of torch.distributed.pipelining's Schedule1F1B on the package's stage."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    pkg = import_package(package)
    module = pkg.stage(rank)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    loss_fn = pkg.criterion()
    schedule = Schedule1F1B(stage, micro, loss_fn=lambda out, y: loss_fn(out, y))
    optim = torch.optim.SGD(module.parameters(), lr=0.01)
    times = []
    for step in range(steps):
        torch.manual_seed(step)
        x, y = pkg.example_inputs(batch)["x"], pkg.example_targets(batch)
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        optim.step()
        optim.zero_grad()
        times.append(time.perf_counter() - start)
    dist.barrier()
    dist.destroy_process_group()
    return times


def run_pipelining(package: Path, steps: int, micro: int, batch: int) -> list[float]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"rank": 0},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="fork",
    )
    per_rank = elastic_launch(config, _pipelining_rank)(str(package), steps, micro, batch)
    return [max(a, b) for a, b in zip(per_rank[0], per_rank[1], strict=True)]


def run_pipeplan(package: Path, steps: int, micro: int) -> tuple[list[float], float]:
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        metrics = launch(
            RunOptions(str(package), steps=steps, microbatches=micro, schedule="1f1b", backend="gloo")
        )
    finally:
        del os.environ["OMP_NUM_THREADS"]
    assert metrics is not None
    per_rank = [r["step_times_s"] for r in metrics["ranks"]]
    return [max(ts) for ts in zip(*per_rank, strict=True)], float(metrics["time_per_minibatch_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rounds: list[dict[str, list[float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        package, prediction = write_package(
            Path(tmp) / "pkg", args.width, args.layers, args.batch_size, args.microbatches
        )
        for r in range(args.repeats):
            # Alternate which runtime goes first, so a burst of load from other jobs hits both alike.
            runs = {
                "pipeplan": lambda: run_pipeplan(package, args.steps, args.microbatches)[0],
                "torch": lambda: run_pipelining(package, args.steps, args.microbatches, args.batch_size),
            }
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            rounds.append({name: runs[name]()[args.warmup :] for name in order})
    report(args, prediction, rounds, (load_before, os.getloadavg()))


def report(
    args: argparse.Namespace,
    prediction: dict[str, Any],
    rounds: list[dict[str, list[float]]],
    load: tuple[tuple[float, ...], tuple[float, ...]],
) -> None:
    """Per round, the median step of each runtime run back to back; the ratio is the median of the
    rounds' ratios (robust to load that changes between rounds)."""
    ours = [statistics.median(r["pipeplan"]) for r in rounds]
    theirs = [statistics.median(r["torch"]) for r in rounds]
    ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
    ratio, t_ours, t_theirs = statistics.median(ratios), statistics.median(ours), statistics.median(theirs)
    predicted = prediction["predicted_s"]
    doc = {
        "benchmark": "bench_runtime",
        "setup": {**vars(args), "ranks": 2, "backend": "gloo", "threads_per_rank": 1},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "load_average_before_after": load,
                    "note": "CPU shared with other jobs while measuring; rounds alternate the runtimes"},
        "pipeplan_1f1b_s_per_minibatch": t_ours,
        "torch_pipelining_1f1b_s_per_minibatch": t_theirs,
        "throughput_ratio_pipeplan_over_torch": ratio,
        "round_ratios": ratios,
        "predicted_s_per_minibatch": predicted,
        "prediction_source": "this script: single-process stage fwd+bwd timing, 1F1B formula (see docstring)",
        "stage_fwd_bwd_s_per_microbatch": prediction["stage_fwd_bwd_s"],
        "measured_over_predicted": t_ours / predicted,
        "measured_over_predicted_best_round": min(ours) / predicted,
        "rounds": rounds,
    }  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_runtime.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = [
        "# bench_runtime: pipeplan 1f1b vs torch.distributed.pipelining Schedule1F1B",
        "",
        f"MLP {args.layers} x {args.width}, batch {args.batch_size}, {args.microbatches} microbatches, "
        f"2 gloo ranks (1 thread each) on a {os.cpu_count()}-core CPU shared with other jobs "
        f"(1-min load average {load[0][0]:.2f} before, {load[1][0]:.2f} after). {len(rounds)} rounds of "
        f"{args.steps} steps per runtime ({args.warmup} warm-up steps dropped), the runtimes run back to "
        "back in alternating order; per round the median step (slower rank).",
        "",
        "| round | pipeplan s/minibatch | torch s/minibatch | throughput ratio |",
        "|---:|---:|---:|---:|",
        *(
            f"| {i} | {o:.4f} | {t:.4f} | {t / o:.3f} |"
            for i, (o, t) in enumerate(zip(ours, theirs, strict=True))
        ),
        "",
        f"Throughput ratio pipeplan / torch (median of rounds): **{ratio:.3f}** (target >= 1.0); "
        f"pipeplan {args.batch_size / t_ours:.0f} samples/s, "
        f"torch {args.batch_size / t_theirs:.0f} samples/s.",
        "",
        f"Predicted {predicted:.4f} s per minibatch; measured {t_ours:.4f} s (median round), "
        f"{min(ours):.4f} s (quietest round): measured/predicted **{t_ours / predicted:.2f}** "
        f"({min(ours) / predicted:.2f} in the quietest round; target within 20%). The prediction is this "
        "script's own (stage fwd+bwd timed in one process, 1F1B formula, no communication term), written "
        "into the benchmark package's plan.json; not the partitioner's.",
        "",
    ]
    (RESULTS / "bench_runtime.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
