"""One job, one fate: the ranks die with the launcher, signals end the job in one line, a stopped rank
is named within the timeout. Each test runs ``pipeplan run`` as a real process tree (launcher, fork
server, two gloo ranks) and signals it from outside, as a user or a scheduler would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.runtime.packages import write_package

ROOT = Path(__file__).resolve().parents[2]


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _rank_pid(pkg: Path, launcher: int) -> int:
    """The pid of the rank running stage 1 (its forward writes it, see :func:`_package`), checked to be
    a process of this job before anything signals it."""
    pid = int((pkg / "stage1.pid").read_text())
    assert pid in _descendants(launcher), f"{pid} is not a process of the job {launcher}"
    return pid


def _alive(pids: set[int]) -> set[int]:
    """The pids still running (zombies count as gone)."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _gone(pids: set[int], limit_s: float) -> bool:
    """Whether every process in ``pids`` has ended within ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pids)


@contextmanager
def _training(pkg: Path, timeout: float) -> Iterator[subprocess.Popen[str]]:
    """``pipeplan run`` on ``pkg`` until its first step is done; every process of it is killed after."""
    # steps enough to outlive the test; more would only lengthen building the schedule before step 1
    cmd = [sys.executable, "-m", "cli", "run", str(pkg), "--steps", "100000", "--timeout", str(timeout)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    tree: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while not (pkg / "run" / "progress.jsonl").exists():
            if proc.poll() is not None or time.monotonic() >= deadline:
                proc.kill()  # before reading its output: a live job never closes it
                pytest.fail(f"no first step within 60 s: {proc.communicate()[0]}")
            time.sleep(0.1)
        tree = _descendants(proc.pid)
        yield proc
    finally:
        for pid in _alive(tree | _descendants(proc.pid) | {proc.pid}):
            os.kill(pid, signal.SIGKILL)
        proc.wait()


def _package(tmp_path: Path) -> Path:
    """A two-stage package whose stage 1 writes its process id to ``stage1.pid`` at every forward."""
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    source = (pkg / "stage1.py").read_text()
    pid_file = pkg / "stage1.pid"
    write_pid = (  # through a rename: the test must never read a half-written pid
        f"        import os; tmp = {str(pid_file)!r} + f'.{{os.getpid()}}'\n"
        "        open(tmp, 'w').write(str(os.getpid()))\n"
        f"        os.replace(tmp, {str(pid_file)!r})\n"
    )
    (pkg / "stage1.py").write_text(
        source.replace("    def forward(self, x):\n", "    def forward(self, x):\n" + write_pid)
    )
    return pkg


def _wait(proc: subprocess.Popen[str], limit_s: float) -> tuple[int, float, str]:
    start = time.monotonic()
    out, _ = proc.communicate(timeout=limit_s)
    return proc.returncode, time.monotonic() - start, out


@pytest.mark.slow
def test_sigkill_of_the_launcher_leaves_no_process_behind(tmp_path: Path) -> None:
    timeout = 10.0
    with _training(_package(tmp_path), timeout) as proc:
        tree = _descendants(proc.pid)
        assert len(tree) >= 3  # fork server and two ranks (and the resource tracker)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _gone(tree, timeout), f"left behind: {_alive(tree)} of {tree}"


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_timeout_and_is_named(tmp_path: Path) -> None:
    timeout = 5.0
    pkg = _package(tmp_path)
    with _training(pkg, timeout) as proc:
        os.kill(_rank_pid(pkg, proc.pid), signal.SIGSTOP)
        code, took, out = _wait(proc, timeout + 10)
    assert code == 1, out
    assert took < timeout + 10
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: training failed: rank 1 (stage 1) stopped responding"), out


@pytest.mark.slow
def test_sigterm_ends_the_job_in_one_line(tmp_path: Path) -> None:
    """(SIGINT and SIGHUP take the same path through the elastic agent: exit 130 and 129.)"""
    signum, code = signal.SIGTERM, 143
    with _training(_package(tmp_path), 10.0) as proc:
        tree = _descendants(proc.pid)
        os.kill(proc.pid, signum)
        returncode, _, out = _wait(proc, 20)
        assert _gone(tree, 5), f"left behind: {_alive(tree)} of {tree}"
    assert returncode == code, out
    assert "Traceback" not in out
    assert (
        out.strip().splitlines()[-1]
        == f"error: stopped by {signal.Signals(signum).name}; every rank was stopped with it"
    )
