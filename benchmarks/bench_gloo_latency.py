"""One message between two local gloo ranks: how long does it take, by size?

The cost model charges a cut ``bytes / bandwidth`` and no time per message. On a machine where a
message's fixed cost (wake-ups, the transport) is large against the compute between messages, every
extra microbatch or virtual stage adds messages the plan does not price: this measures that cost, so
a plan's measured/predicted gap at many microbatches (bench_microbatches) or for multi-chunk schedules
(bench_interleaved, bench_zbv) can be read against it.

Two processes, one thread each, ``dist.send``/``dist.recv`` ping-pong of float32 tensors on the gloo
backend (what ``pipeplan run`` uses on CPUs); one-way time = round trip / 2, median of ``--rounds``
rounds of ``--messages`` round trips, after 20 warm-up ones.

Run:  .venv/bin/python benchmarks/bench_gloo_latency.py
(writes benchmarks/results/bench_gloo_latency.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, run as a script
from benchmarks.reporting import free_port, machine, table, write_results

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (16, 4096, 65536, 1 << 20, 16 << 20)


def _rank(rank: int, port: int, messages: int, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows = []
    for size in SIZES:
        tensor = torch.zeros(max(1, size // 4))
        samples = []
        for r in range(rounds):
            for i in range(messages + (20 if r == 0 else 0)):
                if (r == 0 and i == 20) or (r > 0 and i == 0):
                    start = time.perf_counter()
                if rank == 0:
                    dist.send(tensor, 1)
                    dist.recv(tensor, 1)
                else:
                    dist.recv(tensor, 0)
                    dist.send(tensor, 0)
            samples.append((time.perf_counter() - start) / messages / 2)
        rows.append({"bytes": size, "one_way_s": statistics.median(samples), "samples_s": samples})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _cells(row: dict[str, Any]) -> list[str]:
    lo, hi = min(row["samples_s"]) * 1e3, max(row["samples_s"]) * 1e3
    return [str(row["bytes"]), f"{row['one_way_s'] * 1e3:.3f}", f"{lo:.3f} to {hi:.3f}",
            f"{row['bytes'] / row['one_way_s'] / 1e9:.3f}"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100, help="Round trips per round.")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    load = os.getloadavg()
    out = RESULTS / "bench_gloo_latency.raw"
    RESULTS.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank, args=(free_port(), args.messages, args.rounds, str(out)), nprocs=2)
    rows = json.loads(out.read_text())
    out.unlink()
    doc = {
        "benchmark": "bench_gloo_latency",
        "setup": vars(args),
        "machine": machine([load, os.getloadavg()]),
        "rows": rows,
    }  # fmt: skip
    md = [
        "# One gloo message between two local ranks (ping-pong, one thread each)",
        "",
        f"`python benchmarks/bench_gloo_latency.py --messages {args.messages} --rounds {args.rounds}`; "
        f"load {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after.",
        "",
        *table(["bytes", "one-way ms (median)", "rounds' range ms", "GB/s"], map(_cells, rows), "rrrr"),
    ]
    write_results(RESULTS, "bench_gloo_latency", doc, md)
    print("\n".join(md))


if __name__ == "__main__":
    main()
