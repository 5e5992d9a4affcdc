"""The zbv benchmark's own pieces: its package is a zbv package pipeplan runs, its predicted bubbles
are the planner's (the simulation of zbv's lists, the closed forms of zb1p and 1f1b), and the paired
ratios pair rounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_zbv import OURS, THEIRS, _paired, predicted, write_zbv
from runtime.packages.job_config import load_job
from runtime.packages.load import import_package


def test_the_package_lays_4_stages_on_2_ranks_as_a_v(tmp_path: Path) -> None:
    pkg = write_zbv(tmp_path / "pkg", width=8, layers=8, batch=8, micro=4)
    job = load_job(pkg)
    assert job.schedule == "zbv" and job.virtual_stages == 2 and job.world_size == 2
    assert job.stage_ranks == ((0,), (1,), (1,), (0,))
    assert len(import_package(pkg).full_model(0)) == 4


def test_predicted_bubbles_on_equal_stages() -> None:
    """p = 2, M = 4, F = B = W = 1 per stage of the V: zbv idles p - 1 = 1 of 6M + p - 1 = 25 slots;
    zb1p on the 2-stage split (F = B = W = 2) 2 of 3M + p - 1 = 13 slots of 2; 1F1B 1/5."""
    got = predicted([1.0] * 4, [2.0] * 4, 4)
    assert got[OURS] == pytest.approx(1 / 25)
    assert got["pipeplan zb1p"] == pytest.approx(1 / 13)
    assert got["pipeplan 1f1b"] == pytest.approx(1 / 5)


def test_paired_ratios_skip_rounds_where_either_failed() -> None:
    rounds = [
        {OURS: {"s_per_minibatch": 2.0}, THEIRS: {"s_per_minibatch": 3.0}},
        {OURS: {"error": "x"}, THEIRS: {"s_per_minibatch": 3.0}},
    ]
    assert _paired(rounds) == [1.5]
