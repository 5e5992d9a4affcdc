"""runtime.job.run_lock: one job per package folder; the holder is named; a dead holder frees it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.errors import RunError
from runtime.job.run_lock import holder, run_lock

_HOLD = """
import sys, time
from pathlib import Path
from runtime.job.run_lock import run_lock
with run_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def _hold(run_dir: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_job_is_refused_naming_the_first(tmp_path: Path) -> None:
    run_dir = tmp_path / "pkg" / "run"
    run_dir.parent.mkdir()
    proc = _hold(run_dir)
    try:
        assert str(holder(run_dir)).startswith(f"pid {proc.pid} on ")
        refused = rf"being trained by another `pipeplan run` \(pid {proc.pid} on"
        with pytest.raises(RunError, match=refused), run_lock(run_dir):
            pass
    finally:
        proc.kill()
        proc.wait()
    time.sleep(0.1)
    assert holder(run_dir) is None  # the kernel released the dead holder's lock
    with run_lock(run_dir):
        assert holder(run_dir) is not None


def test_nested_holds_in_one_process_and_no_folder_for_a_missing_package(tmp_path: Path) -> None:
    run_dir = tmp_path / "pkg" / "run"
    run_dir.parent.mkdir()
    with run_lock(run_dir), run_lock(run_dir):  # the CLI around the launcher
        pass
    assert not run_dir.exists()  # the lock lies beside run/, which a refused run never creates
    with run_lock(tmp_path / "nope" / "run"):
        pass
    assert not (tmp_path / "nope").exists()
