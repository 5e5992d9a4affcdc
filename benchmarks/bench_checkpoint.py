"""Checkpoint save time of vgg16 on 2 stages: DCP (the runtime's) against the per-stage torch.save it
replaced.

Two local gloo ranks, each holding its stage of a vgg16 package (``pipeplan partition --gpus 2
--straight --schedule 1f1b`` of ``pipeplan profile vgg16 --batch-size 8 --input-shape 3,64,64``) with
Adam's state after one step: 138 M parameters, weights and two moments, about 1.66 GB in all. Every
round saves the same state in each way, the order rotating from round to round, each into a fresh
folder:

- ``per-stage``: what pipeplan wrote before DCP: each stage's first rank ``torch.save`` s
  ``stage<K>.pt`` (weights, optimizer state) through a temporary file and a rename, each rank its
  ``rank<R>.pt``, then after a barrier rank 0 ``meta.json`` (reproduced here from
  ``runtime/checkpoints/step_folders.py`` at commit f1e4850);
- ``dcp``: :class:`runtime.checkpoints.step_folders.Saver` as ``pipeplan run`` saves, every rank writing
  its own file (``dcp.save``, which fsyncs every file it writes), then rank 0 publishes the step;
- ``dcp, no fsync``: the same through ``dcp.save`` with ``FileSystemWriter(sync_files=False)``, to
  tell the format's cost from the durability's (the per-stage save never fsynced);
- ``dcp async``: ``Saver(background=True)``: ``blocked`` is what training waits for (the copy of
  the tensors), ``complete`` until the step is published.

A time is the wall seconds from a barrier to the moment both ranks are done (the slower rank's).
The whole command is timed too: ``pipeplan run`` of the package for 3 steps with a checkpoint after
each, whose metrics.json records each checkpoint's seconds as the run waited for it. The load
average is recorded with every round (the machine is shared).

Run:  .venv/bin/python benchmarks/bench_checkpoint.py [--rounds 3] [--work DIR]
(writes benchmarks/results/bench_checkpoint.{json,md})
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.reporting import free_port, write_results
from runtime.checkpoints import resume_settings as resume
from runtime.checkpoints import step_folders as checkpoint
from runtime.checkpoints import train_state
from runtime.executing.optimizer import OptimSettings, make_optimizer, make_scheduler
from runtime.packages.job_config import load_job
from runtime.packages.load import import_package
from runtime.packages.tensor_names import model_names
from runtime.settings.run_options import RunOptions

RESULTS = Path(__file__).resolve().parent / "results"
WAYS = ("per-stage", "dcp", "dcp, no fsync", "dcp async")
SETTINGS = OptimSettings(optimizer="adam", lr=1e-4)


def _save_v1(root: Path, step: int, rank: int, state: dict[str, Any]) -> None:
    """pipeplan's per-stage checkpoint before DCP: torch.save through a temporary file and a rename."""

    def save(path: Path, obj: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(obj, tmp)
        os.replace(tmp, path)

    save(root / f"step-{step}" / f"stage{rank}.pt", state)
    save(root / f"step-{step}" / f"rank{rank}.pt", {"rng": {"cpu": torch.get_rng_state()}, "step": step})
    dist.barrier()
    if rank == 0:
        (root / f"step-{step}" / "meta.json").write_text(
            json.dumps({"schema": "pipeplan.checkpoint/1", "step": step})
        )


def _timed(work: Any) -> float:
    dist.barrier()
    began = time.perf_counter()
    work()
    dist.barrier()
    return time.perf_counter() - began


def _rank(rank: int, port: int, package: str, work: str, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    job = load_job(package)
    pkg = import_package(job.package)
    names = model_names(pkg, job)
    module = pkg.stage(rank)
    optimizer = make_optimizer(SETTINGS, module.parameters())
    scheduler = make_scheduler(SETTINGS, optimizer, 10)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad()
    held = [train_state.Held(rank, module, optimizer)]
    meta = resume.record(RunOptions(package, steps=10), job, 10, names)
    v1_state = {
        "model": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "optim": SETTINGS.record(),
        "scaler": None,
        "precision": "fp32",
        "step": 1,
    }
    rows = []
    for r in range(rounds):
        for way in WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]:
            root = Path(work) / f"{way.replace(' ', '-').replace(',', '')}-{r}"
            state = train_state.rank_entries(names, held, rank, 1, scheduler, None)
            load = os.getloadavg()[0]
            if way == "per-stage":
                seconds = _timed(lambda root=root: _save_v1(root, 1, rank, v1_state))
                blocked = seconds
            elif way == "dcp, no fsync":
                writer = dcp.FileSystemWriter(str(root / "step-1"), sync_files=False)
                seconds = _timed(
                    lambda writer=writer, state=state: dcp.save(
                        state, storage_writer=writer, process_group=group
                    )
                )
                blocked = seconds
            else:
                saver = checkpoint.Saver(root, rank, group, meta, background=way == "dcp async")
                blocked = _timed(lambda saver=saver, state=state: saver.save(1, state))
                seconds = blocked + _timed(saver.close)
            rows.append({"round": r, "way": way, "seconds": seconds, "blocked_s": blocked, "load": load})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _pipeplan(*args: str, cwd: Path) -> None:
    env = {**os.environ, "COLUMNS": "120"}
    subprocess.run(
        [sys.executable, "-m", "cli", *args], check=True, cwd=cwd, env=env, stdout=subprocess.DEVNULL
    )


def _package(work: Path) -> Path:
    """vgg16 profiled and partitioned straight over 2 ranks (1f1b), as the demo profiles it."""
    profile = str(work / "vgg16.json")
    _pipeplan("profile", "vgg16", "--batch-size", "8", "--input-shape", "3,64,64", "-o", profile, cwd=work)
    _pipeplan("partition", "--profile", profile, "--gpus", "2", "--straight", "--schedule", "1f1b", "-o",
              str(work / "models"), cwd=work)  # fmt: skip
    return next((work / "models").glob("*/gpus=2"))


def _whole_run(package: Path, work: Path) -> dict[str, Any]:
    """``pipeplan run`` with a checkpoint after each of 3 steps: the seconds each checkpoint took."""
    load = os.getloadavg()[0]
    began = time.perf_counter()
    _pipeplan("run", str(package), "--steps", "3", "--checkpoint-every", "1", "--optimizer", "adam", "--lr",
              "1e-4", "--checkpoint-dir", str(work / "run-ckpt"), "--timeout", "600", cwd=work)  # fmt: skip
    wall = time.perf_counter() - began
    metrics = json.loads((package / "run" / "metrics.json").read_text())
    return {"wall_s": wall, "checkpoint_s": [c["seconds"] for c in metrics["checkpoints"]], "load": load}


def _report(rows: list[dict[str, Any]], whole: dict[str, Any], rounds: int, bytes_total: int) -> None:
    summary = []
    for way in WAYS:
        mine = [r for r in rows if r["way"] == way]
        summary.append(
            {
                "way": way,
                "median_s": statistics.median(r["seconds"] for r in mine),
                "median_blocked_s": statistics.median(r["blocked_s"] for r in mine),
                "min_s": min(r["seconds"] for r in mine),
                "max_s": max(r["seconds"] for r in mine),
            }
        )
    doc = {
        "bench": "bench_checkpoint",
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "rounds": rounds,
        "checkpoint_bytes": bytes_total,
        "summary": summary,
        "rounds_detail": rows,
        "whole_run": whole,
    }
    base = summary[0]["median_s"]
    lines = [
        "# Checkpoint save time: vgg16, 2 stages, Adam (bench_checkpoint.py)",
        "",
        f"{bytes_total / 1e9:.2f} GB per checkpoint (weights and Adam's two moments), 2 gloo ranks, "
        f"{rounds} rounds per way in rotating order, {os.cpu_count()} CPUs shared with other jobs "
        f"(load {min(r['load'] for r in rows):.1f} to {max(r['load'] for r in rows):.1f}).",
        "",
        "| way | median s | training blocked s | min s | max s | vs per-stage |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {s['way']} | {s['median_s']:.2f} | {s['median_blocked_s']:.2f} | {s['min_s']:.2f} "
            f"| {s['max_s']:.2f} | {s['median_s'] / base:.2f}x |"
            for s in summary
        ),
        "",
        f"Whole command: `pipeplan run` for 3 steps with a DCP checkpoint after each: "
        f"{whole['wall_s']:.1f} s wall; the checkpoints took "
        f"{', '.join(f'{s:.2f}' for s in whole['checkpoint_s'])} s as the run measured them "
        f"(load {whole['load']:.1f}).",
        "",
    ]
    write_results(RESULTS, "bench_checkpoint", doc, "\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--work", default=None, help="a folder for the package and checkpoints [a temp folder]"
    )
    args = parser.parse_args()
    work = Path(args.work or f"/tmp/bench_checkpoint_{os.getpid()}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    package = _package(work)
    out = work / "rows.json"
    mp.start_processes(
        _rank,
        args=(free_port(), str(package), str(work), args.rounds, str(out)),
        nprocs=2,
        start_method="spawn",
    )
    rows = json.loads(out.read_text())
    job = load_job(package)
    names = model_names(import_package(job.package), job)
    bytes_total = 3 * sum(
        math.prod(shape) * torch.empty((), dtype=getattr(torch, dt)).element_size()
        for held in names.tensors
        for shape, dt in held.values()
    )
    _report(rows, _whole_run(package, work), args.rounds, bytes_total)


if __name__ == "__main__":
    main()
