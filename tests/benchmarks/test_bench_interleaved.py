"""The interleaved benchmark's own pieces: its package is an interleaved package pipeplan runs, its
predicted bubbles are the closed forms, and the paired ratios pair rounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_interleaved import RUNS, paired, predicted, write_interleaved
from runtime.packages.job_config import load_job
from runtime.packages.load import import_package


def test_the_package_lays_4_stages_on_2_ranks(tmp_path: Path) -> None:
    pkg = write_interleaved(tmp_path / "pkg", width=8, layers=8, batch=8, micro=4)
    job = load_job(pkg)
    assert job.schedule == "interleaved" and job.virtual_stages == 2 and job.world_size == 2
    assert job.stage_ranks == ((0,), (1,), (0,), (1,))
    assert len(import_package(pkg).full_model(0)) == 4


def test_predicted_bubbles_are_the_closed_forms_on_equal_stages() -> None:
    """p = 2, v = 2, M = 4, F + B = 3 per stage: interleaved idles (p-1)/(vM + p-1) = 1/9 of its
    span, 1F1B on the 2-stage split (p-1)/(M + p-1) = 1/5."""
    got = predicted([1.0] * 4, [2.0] * 4, 4)
    assert got["pipeplan interleaved"] == pytest.approx(1 / 9)
    assert got["pipeplan 1f1b"] == pytest.approx(1 / 5)


def test_paired_ratios_skip_rounds_where_either_failed() -> None:
    ours, theirs = "pipeplan interleaved", "torch ScheduleInterleaved1F1B"
    rounds = [
        {ours: {"s_per_minibatch": 2.0}, theirs: {"s_per_minibatch": 3.0}},
        {ours: {"error": "x"}, theirs: {"s_per_minibatch": 3.0}},
    ]
    assert paired(rounds, RUNS[0], RUNS[1]) == [1.5]
