"""metrics.json's per-stage predicted against measured: compute, communication, bubble (memory linked)."""

from __future__ import annotations

import pytest

from runtime.observing.fidelity import stage_report
from runtime.observing.metrics import RankMetrics, Recorder, summarize
from runtime.packages.job_config import StagePrediction


def _rank(
    rank: int, stage: int, compute: tuple[float, ...], comm: tuple[float, ...], **kw: object
) -> RankMetrics:
    times = tuple(c + m + 0.01 for c, m in zip(compute, comm, strict=True))
    return RankMetrics(
        rank, stage, sum(times), sum(compute), sum(comm), times, step_compute_s=compute, step_comm_s=comm,
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_the_recorder_splits_blocked_communication_by_step_as_it_splits_compute() -> None:
    recorder = Recorder(rank=0, stage=0)
    recorder.mark_step(3, comm_s=0.6)  # a pipedream replica's round of 3 minibatches
    recorder.mark_step(1, comm_s=0.7)
    assert recorder.step_comm_s() == pytest.approx((0.2, 0.2, 0.2, 0.1))
    recorder.mark_step(1)  # (nothing said: no per-step figure is made up)
    assert len(recorder.step_comm_s()) == 4


def test_stage_report_measures_after_the_warm_up_and_sets_the_plan_beside_it() -> None:
    ranks = [
        _rank(0, 0, (2.0, 0.3, 0.3, 0.3), (1.0, 0.1, 0.1, 0.1)),
        _rank(1, 0, (2.0, 0.3, 0.3, 0.3), (1.0, 0.3, 0.3, 0.3)),  # a replica: comm and bubble averaged
        _rank(2, 1, (1.0, 0.5, 0.5, 0.5), (0.0, 0.2, 0.2, 0.2)),
    ]
    plan = [{"compute_s": 0.5, "comm_s": 0.1, "bubble_fraction": 0.25}, {"compute_s": 0.4, "comm_s": 0.0}]
    predicted = [StagePrediction.of(s) for s in plan]
    stages = stage_report(summarize(ranks, 8, 1.0, warmup=1)["stages"], ranks, predicted, warmup=1)
    first, second = stages
    assert first["compute_s_per_minibatch"] == pytest.approx(0.6)  # (two replicas summed)
    assert first["predicted_compute_s_per_minibatch"] == 0.5
    assert first["compute_measured_over_predicted"] == pytest.approx(1.2)
    assert (
        first["comm_s_per_minibatch"] == pytest.approx(0.2) and first["predicted_comm_s_per_minibatch"] == 0.1
    )
    assert "comm_measured_over_predicted" not in first  # blocked time against wire time: no ratio
    bubbles = [1 - 0.9 / (0.9 + 0.3 + 0.03), 1 - 0.9 / (0.9 + 0.9 + 0.03)]  # the timed steps only
    assert first["bubble_fraction"] == pytest.approx(sum(bubbles) / 2)
    assert first["predicted_bubble_fraction"] == 0.25
    assert first["bubble_measured_over_predicted"] == pytest.approx(first["bubble_fraction"] / 0.25)
    assert first["bubble_difference"] == pytest.approx(first["bubble_fraction"] - 0.25)
    assert [s["memory"] for s in stages] == ["#/memory/stages/0", "#/memory/stages/1"]
    # an old plan.json says nothing of the bubble: not predicted, no ratio, the rest as before
    assert second["predicted_bubble_fraction"] is None and second["bubble_measured_over_predicted"] is None
    assert second["bubble_fraction"] == pytest.approx(1 - 1.5 / (1.5 + 0.6 + 0.03))
    assert second["predicted_comm_s_per_minibatch"] == 0.0


def test_a_rank_hosting_several_stages_is_measured_against_their_sum() -> None:
    ranks = [
        _rank(0, 0, (0.3, 0.3), (0.1, 0.1), hosted=(0, 3)),
        _rank(1, 1, (0.3, 0.3), (0.1, 0.1), hosted=(1, 2)),
    ]
    pairs = ((0.1, 0.2), (0.2, 0.1), (0.2, 0.1), (0.1, 0.2))  # (compute, bubble) of stages 0-3
    plan = [{"compute_s": c, "comm_s": 0.01, "bubble_fraction": b} for c, b in pairs]
    stages = stage_report(
        summarize(ranks, 8, 1.0, warmup=0)["stages"], ranks, [StagePrediction.of(s) for s in plan], warmup=0
    )
    assert [s["predicted_compute_s_per_minibatch"] for s in stages] == pytest.approx([0.2, 0.4])
    assert [s["predicted_comm_s_per_minibatch"] for s in stages] == pytest.approx([0.02, 0.02])
    assert [s["predicted_bubble_fraction"] for s in stages] == [0.2, 0.1]


def test_a_hand_written_plan_predicts_no_stage_time() -> None:
    assert StagePrediction.of({"compute_s": 0.0, "comm_s": 0.0}) == StagePrediction()
    assert StagePrediction.of({}) == StagePrediction()
    assert StagePrediction.of({"compute_s": 0.1, "bubble_fraction": 0.0}) == StagePrediction(0.1, 0.0, 0.0)


def test_a_tensor_parallel_stage_is_predicted_for_all_its_ranks() -> None:
    """metrics.json sums a stage's compute over every rank; each of a TP4 stage's four ranks
    computes its share the whole time, so the stage's prediction is four ranks' (was a quarter)."""
    from runtime.packages.job_config import StagePrediction

    plain = StagePrediction.of({"compute_s": 0.1, "comm_s": 0.01})
    split = StagePrediction.of({"compute_s": 0.1, "comm_s": 0.01, "tensor_parallel": 4})
    assert plain.compute_s == pytest.approx(0.1) and split.compute_s == pytest.approx(0.4)
