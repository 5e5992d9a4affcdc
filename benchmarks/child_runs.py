"""What the benchmarks that run ``pipeplan`` as a user does share: a command timed as a child process
(wall, the child's own CPU time, the load before it), and a profile estimated for a device model
(``pipeplan profile --device-model``: no GPU, nothing of the model's size built).

bench_layouts.py times ``partition`` on such profiles; bench_published_layouts.py prices layouts on
them. One copy of each, so both measure the same commands.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def pipeplan() -> list[str]:
    """The ``pipeplan`` command of this checkout (its cli.py under this interpreter)."""
    return [sys.executable, str(ROOT / "cli.py")]


def timed(command: list[str], cwd: Path, check: bool = True) -> dict[str, Any]:
    """Run ``command`` in ``cwd`` with this checkout on PYTHONPATH: its wall seconds, the CPU seconds
    of the child (user + system, from ``RUSAGE_CHILDREN``: the figure another job's load does not
    change), the 1-minute load average before it, its exit status and its output's tail.

    Raises:
        subprocess.CalledProcessError: ``check`` and the command failed (its output attached).
    """
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    if check and done.returncode:
        raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
    return {
        "command": " ".join(["pipeplan", *command[2:]] if command[:2] == pipeplan() else command),
        "wall_s": round(wall, 2), "cpu_s": round(user + system, 2), "user_s": round(user, 2),
        "sys_s": round(system, 2), "load_before": round(load, 2), "rc": done.returncode,
        "tail": (done.stdout + done.stderr)[-2000:],
    }  # fmt: skip


def estimated_profile(
    spec: Path, out: Path, batch: int, tokens: int = 4096, device: str = "h100", dtype: str = "bfloat16"
) -> tuple[Path, dict[str, Any]]:
    """``pipeplan profile hf:SPEC`` estimated for ``device`` at ``batch`` sequences of ``tokens``
    (one a microbatch, scaled), written to ``out``: its path and the timed command."""
    command = [
        *pipeplan(), "profile", f"hf:{spec}", "-o", str(out), "--device-model", device,
        "--batch-size", str(batch), "--microbatch-size", "1", "--input-shape", str(tokens), "--dtype", dtype,
    ]  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    return out, timed(command, out.parent)
