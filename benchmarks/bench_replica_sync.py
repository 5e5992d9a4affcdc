"""A replicated stage's gradient sum: the runtime's own all-reduce against DistributedDataParallel's.

The runtime sums a stage's gradients over its replicas once per step, after the last backward
(``Comm.all_reduce_sum``: buckets of at most 25 MiB, as DDP's). DDP starts each bucket's all-reduce
during the backward as soon as the bucket's gradients are ready (``no_sync()`` for the other
microbatches), so some of the communication hides behind the last microbatch's backward. This
measures what that overlap is worth on a stage-sized module, to decide whether the runtime should
hand the sum to DDP.

Two local gloo ranks (one replica each), a stage of 8 Linear(1024, 1024) layers with ReLU (8.4 M
parameters, 32 MiB of gradients), 4 microbatches of 8 samples per step, SGD; each round times
``--steps`` steps of each way, alternating which goes first; both ways reach the same gradients
(checked: max difference after the sum).

Run:  .venv/bin/python benchmarks/bench_replica_sync.py
(writes benchmarks/results/bench_replica_sync.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.reporting import free_port, write_results
from runtime.executing.comm import Comm

RESULTS = Path(__file__).resolve().parent / "results"
WIDTH, LAYERS, MICRO, SAMPLES = 1024, 8, 4, 8


def _stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


def _steps(way: str, module: nn.Module, wrapped: nn.Module, comm: Comm, steps: int, rank: int) -> float:
    """Seconds per step of ``way`` (``runtime``: backward, then the runtime's sum; ``ddp``: DDP's)."""
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    data = torch.randn(MICRO, SAMPLES, WIDTH, generator=torch.Generator().manual_seed(rank))
    dist.barrier()
    began = time.perf_counter()
    for _ in range(steps):
        for j in range(MICRO):
            last = j == MICRO - 1
            if way == "ddp" and not last:
                with wrapped.no_sync():  # type: ignore[operator]
                    wrapped(data[j]).square().mean().backward()
            else:
                (wrapped if way == "ddp" else module)(data[j]).square().mean().backward()
        if way == "runtime":
            comm.all_reduce_sum([p.grad for p in module.parameters()], dist.group.WORLD)  # type: ignore[arg-type,misc]
            for p in module.parameters():
                p.grad.div_(2)  # (DDP averages over the group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    return (time.perf_counter() - began) / steps


def _same_gradients(module: nn.Module, wrapped: nn.Module, comm: Comm, rank: int) -> float:
    """The largest difference between the two ways' summed gradients of one step."""
    data = torch.randn(MICRO, SAMPLES, WIDTH, generator=torch.Generator().manual_seed(rank))
    for j in range(MICRO):
        module(data[j]).square().mean().backward()
    comm.all_reduce_sum([p.grad for p in module.parameters()], dist.group.WORLD)  # type: ignore[arg-type,misc]
    ours = [p.grad.clone() / 2 for p in module.parameters()]  # type: ignore[union-attr]
    module.zero_grad(set_to_none=True)
    for j in range(MICRO):
        if j < MICRO - 1:
            with wrapped.no_sync():  # type: ignore[operator]
                wrapped(data[j]).square().mean().backward()
        else:
            wrapped(data[j]).square().mean().backward()
    diff = max(float((p.grad - g).abs().max()) for p, g in zip(module.parameters(), ours, strict=True))  # type: ignore[operator]
    module.zero_grad(set_to_none=True)
    return diff


def _rank(rank: int, port: int, rounds: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    module = _stage()
    wrapped = DistributedDataParallel(module)  # (shares the module's parameters)
    comm = Comm(dist.group.WORLD, torch.device("cpu"))  # type: ignore[arg-type]
    diff = _same_gradients(module, wrapped, comm, rank)
    rows = []
    for r in range(rounds):
        for way in ("runtime", "ddp") if r % 2 == 0 else ("ddp", "runtime"):
            load = os.getloadavg()[0]
            rows.append(
                {
                    "round": r,
                    "way": way,
                    "step_s": _steps(way, module, wrapped, comm, steps, rank),
                    "load": load,
                }
            )
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "max_grad_diff": diff}))
    dist.destroy_process_group()


def _report(doc: dict[str, Any], rounds: int, steps: int) -> None:
    rows = doc["rows"]
    med = {w: statistics.median(r["step_s"] for r in rows if r["way"] == w) for w in ("runtime", "ddp")}
    paired = [
        a["step_s"] / b["step_s"]
        for a, b in zip(
            [r for r in rows if r["way"] == "ddp"], [r for r in rows if r["way"] == "runtime"], strict=True
        )
    ]
    result = {
        "bench": "bench_replica_sync",
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "rounds": rounds,
        "steps_per_round": steps,
        "median_step_s": med,
        "ddp_over_runtime_per_round": paired,
        **doc,
    }
    loads = [r["load"] for r in rows]
    params = sum(p.numel() for p in _stage().parameters())
    lines = [
        "# A replicated stage's gradient sum: the runtime's all-reduce against DDP's (bench_replica_sync.py)",
        "",
        f"2 gloo ranks, {LAYERS} x Linear({WIDTH}, {WIDTH}) ({params / 1e6:.1f} M parameters), "
        f"{MICRO} microbatches of {SAMPLES} per step, {rounds} rounds of {steps} steps per way, "
        f"alternating; {os.cpu_count()} CPUs shared with other jobs "
        f"(load {min(loads):.1f} to {max(loads):.1f}).",
        "",
        "| way | median s per step |",
        "|---|---:|",
        f"| runtime (backward, then Comm.all_reduce_sum) | {med['runtime'] * 1e3:.1f} ms |",
        f"| DistributedDataParallel (no_sync, overlap in the last backward) | {med['ddp'] * 1e3:.1f} ms |",
        "",
        f"DDP / runtime per round: {', '.join(f'{x:.2f}' for x in paired)} "
        f"(median {statistics.median(paired):.2f}); "
        f"the two ways' summed gradients differ by at most {doc['max_grad_diff']:.2g}.",
        "",
    ]
    write_results(RESULTS, "bench_replica_sync", result, "\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    out = Path(f"/tmp/bench_replica_sync_{os.getpid()}.json")
    mp.start_processes(
        _rank, args=(free_port(), args.rounds, args.steps, str(out)), nprocs=2, start_method="spawn"
    )
    _report(json.loads(out.read_text()), args.rounds, args.steps)
    out.unlink()


if __name__ == "__main__":
    main()
