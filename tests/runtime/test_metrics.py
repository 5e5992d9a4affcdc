"""metrics.json: per-stage compute is the median step after the warm-up, replicas summed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from runtime.observing.metrics import RankMetrics, Recorder, cpu_share, summarize


def test_recorder_splits_compute_by_step() -> None:
    recorder = Recorder(rank=0, stage=0)
    for seconds in (0.5, 0.1, 0.2):
        recorder.seconds["compute"] += seconds
        recorder.mark_step()
    assert recorder.step_compute_s() == pytest.approx((0.5, 0.1, 0.2))


def _rank(rank: int, stage: int, compute: tuple[float, ...]) -> RankMetrics:
    times = tuple(c + 0.01 for c in compute)
    return RankMetrics(rank, stage, sum(times), sum(compute), 0.0, times, step_compute_s=compute)


def test_stage_compute_skips_the_warm_up_and_sums_replicas() -> None:
    ranks = [
        _rank(0, 0, (2.0, 0.3, 0.3, 0.4)),
        _rank(1, 0, (2.0, 0.3, 0.3, 0.3)),
        _rank(2, 1, (1.0, 0.5, 0.5, 0.5)),
    ]
    doc = summarize(ranks, batch_size=8, predicted_s=0.5, warmup=1)
    assert doc["stages"] == [
        {"stage": 0, "compute_s_per_minibatch": pytest.approx(0.6), "compute_cpu_share": None},
        {"stage": 1, "compute_s_per_minibatch": pytest.approx(0.5), "compute_cpu_share": None},
    ]
    assert doc["batch_size"] == 8 and doc["time_per_minibatch_s"] == pytest.approx(0.51)
    halved = [replace(r, compute_cpu_s=r.compute_s / 2) for r in ranks]  # time-sliced: half a core
    shares = [s["compute_cpu_share"] for s in summarize(halved, 8, 0.5, 1)["stages"]]
    assert shares == pytest.approx([0.5, 0.5])


def test_a_step_over_a_round_of_minibatches_shares_its_compute() -> None:
    recorder = Recorder(rank=0, stage=0)
    recorder.seconds["compute"] = 0.9
    recorder.mark_step(3)  # a pipedream replica of a 3-replica stage steps once per 3 minibatches
    recorder.seconds["compute"] = 1.0
    recorder.mark_step(1)
    assert recorder.step_compute_s() == pytest.approx((0.3, 0.3, 0.3, 0.1))


def test_cpu_share_is_compute_cpu_time_over_wall_time_on_cpus_only() -> None:
    ranks = [{"compute_s": 2.0, "compute_cpu_s": 1.0}, {"compute_s": 2.0, "compute_cpu_s": 2.0}]
    assert cpu_share({"device": "cpu", "ranks": ranks}) == 0.75
    assert cpu_share({"device": "cuda", "ranks": ranks}) is None
    assert cpu_share({"device": "cpu", "ranks": [{"compute_s": 1.0}]}) is None
