"""Faults end the job quickly with the failing rank named; bad input is one RunError line."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from runtime.errors import JobFailed, RunError
from runtime.job.launch import free_port, launch
from runtime.job.worker import run_rank
from runtime.settings.run_options import RunOptions
from tests.runtime.helpers import run
from tests.runtime.packages import write_package

torch.set_num_threads(1)


def _sabotage(pkg: Path, stage: int, statement: str) -> None:
    """Make ``stage``'s forward run ``statement`` from its 4th call on (start-up uses the first)."""
    path = pkg / f"stage{stage}.py"
    source = path.read_text().replace(
        "    def forward(self, x):\n",
        f"    calls = [0]\n\n    def forward(self, x):\n        self.calls[0] += 1\n"
        f"        if self.calls[0] > 3:\n            {statement}\n",
    )
    path.write_text(source)


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_job_with_its_error(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1, 1), microbatches=2, batch_size=4)
    _sabotage(pkg, 1, 'raise ValueError("boom in stage one")')
    start = time.monotonic()
    with pytest.raises(
        JobFailed, match=r"rank 1 \(stage 1\) failed: .*ValueError.*boom in stage one"
    ) as info:
        run(pkg, steps=5, timeout=20)
    assert info.value.rank == 1
    assert time.monotonic() - start < 20


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_job(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    _sabotage(pkg, 0, "import os; os._exit(7)")
    start = time.monotonic()
    with pytest.raises(JobFailed, match=r"rank 0 \(stage 0\) failed: the process died \(exit code 7\)"):
        run(pkg, steps=5, timeout=20)
    assert time.monotonic() - start < 20


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    with pytest.raises(
        JobFailed, match=r"rank 1 \(stage 1\) failed: RunError: the loss is (nan|inf) at step"
    ):
        run(pkg, steps=20, lr=1e30, timeout=20)


def test_missing_package_is_a_run_error(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="does not exist"):
        launch(RunOptions(str(tmp_path / "nope")))


def test_world_size_must_match_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(RunError, match="runs on 2 ranks but the job has 3"):
        run_rank(RunOptions(str(pkg)))


def test_nodes_must_share_the_ranks_evenly(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1, 1))
    with pytest.raises(RunError, match="cannot share evenly"):
        launch(RunOptions(str(pkg), nnodes=2, master_port=29500))


@pytest.mark.slow
def test_unreachable_master_is_a_run_error(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1))
    options = RunOptions(str(pkg), nnodes=2, node_rank=1, master_port=free_port(), timeout=3)
    with pytest.raises(RunError, match="no rendezvous with master"):
        launch(options)


@pytest.mark.slow
def test_a_rank_that_hangs_ends_the_job_after_the_timeout(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    _sabotage(pkg, 1, "import time; time.sleep(3600)")
    start = time.monotonic()
    # rank 0's wait names it; on a loaded machine the launcher's watch of its heartbeat may be first
    blamed = r"rank 1 \(stage 1\) stopped responding: (rank 0 \(stage 0\) waited 3 s|no sign of life for 3 s)"
    with pytest.raises(JobFailed, match=blamed):
        run(pkg, steps=5, timeout=3)
    assert time.monotonic() - start < 20


@pytest.mark.slow
def test_a_rank_stopped_during_start_up_is_named_within_the_timeout(tmp_path: Path) -> None:
    """SIGSTOP while rank 1 imports its stage: the launcher sees it fall silent and ends the job
    within --timeout (plus the watch's second), blaming rank 1, not rank 0 whose wait would time out."""
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    stamp = tmp_path / "stopped"
    path = pkg / "stage1.py"
    path.write_text(
        "import os, signal, time\n"
        f"if os.environ.get('RANK') == '1':\n    open({str(stamp)!r}, 'w').write(str(time.time()))\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n" + path.read_text()
    )
    with pytest.raises(JobFailed, match=r"rank 1 \(stage 1\) stopped responding: no sign of life for"):
        run(pkg, steps=3, timeout=4)
    assert time.time() - float(stamp.read_text()) < 4 + 10


def test_a_data_spec_naming_nothing_is_a_run_error(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg")
    with pytest.raises(RunError, match="does not exist"):
        launch(RunOptions(str(pkg), data=str(tmp_path / "nope.py:make")))
    with pytest.raises(RunError, match="no module named"):
        launch(RunOptions(str(pkg), data="no_such_module_xyz:make"))
    with pytest.raises(RunError, match="no module named"):
        launch(RunOptions(str(pkg), data="no_such_pkg_xyz.sub:make"))


def test_a_plan_without_stage_code_is_a_run_error(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg")
    (pkg / "__init__.py").unlink()
    with pytest.raises(RunError, match="no stage code"):
        launch(RunOptions(str(pkg)))
