"""The plan-fidelity benchmark's own arithmetic: Spearman's rank correlation and where it cuts."""

from __future__ import annotations

import math

import pytest

from benchmarks.bench_fidelity import (
    _worst_stage,
    _worst_stage_table,
    cut_layers,
    device_memory,
    memory_ratios,
    spearman,
)


def test_spearman_orders() -> None:
    assert spearman([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 25.0, 90.0]) == pytest.approx(1.0)
    assert spearman([1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    # one swapped pair of 5: 1 - 6 * sum(d^2) / (n (n^2 - 1)) = 1 - 6 * 2 / 120
    assert spearman([1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 3.0, 2.0, 4.0, 5.0]) == pytest.approx(0.9)


def test_spearman_ties_get_mean_ranks() -> None:
    # ranks of y: 1, 2.5, 2.5, 4; Pearson of (1, 2, 3, 4) and those
    expected = 4.5 / math.sqrt(5.0 * 4.5)
    assert spearman([1.0, 2.0, 3.0, 4.0], [0.1, 0.5, 0.5, 0.9]) == pytest.approx(expected)
    assert math.isnan(spearman([1.0, 2.0], [3.0, 3.0]))
    with pytest.raises(ValueError):
        spearman([1.0], [1.0])


def test_cut_layers_by_cumulative_compute() -> None:
    nodes = [{"id": "x", "op": "input", "forward_ms": 0.0, "backward_ms": 0.0}] + [
        {"id": f"l{i}", "op": "call_module", "forward_ms": ms, "backward_ms": ms}
        for i, ms in enumerate([1.0, 1.0, 6.0, 1.0, 1.0])
    ]
    profile = {"nodes": nodes}
    assert cut_layers(profile, (0.1,)) == ["l0"]
    assert cut_layers(profile, (0.25,)) == ["l2"]  # l0 + l1 is 20%: the big layer closes the stage
    assert cut_layers(profile, (0.25, 0.9)) == ["l2", "l3"]
    assert cut_layers(profile, (0.99,)) == ["l3"]  # never the last layer


def test_the_worst_stage_is_the_furthest_from_its_prediction_either_way() -> None:
    def stage(predicted: float, measured: float | None) -> dict[str, float | None]:
        return {"predicted_compute_s": predicted, "measured_compute_s": measured, "predicted_comm_s": 0.0}

    stages = [stage(0.1, 0.15), stage(0.1, 0.06), stage(0.1, None)]  # 1.5x, then 0.6x (1/1.67): the 2nd
    assert _worst_stage(stages) == (1, stages[1])
    assert _worst_stage([stage(0.1, None)]) is None
    run = {
        "model": "m",
        "plan": "p",
        "stages": stages,
        "load_1min": 0.5,
    }  # (a run recorded before the bubble)
    (row,) = _worst_stage_table([run])[-2:-1]
    assert row == "| m | p | 1 | 100.0 : 60.0 | 0.60 | 0.0 : - | - : - | - | - | 0.50 |"


def test_a_rank_hosting_several_stages_is_compared_with_their_sum() -> None:
    """zbv on 2 ranks: rank 0 hosts stages 0 and 3 and reports under 0, rank 1 stages 1 and 2 under
    1; a stage of its own (1f1b) is compared with its own prediction."""
    stages = [{"predicted_memory_bytes": p, "measured_memory_bytes": m} for p, m in
              [(100, 300), (50, 120), (70, None), (200, None)]]  # fmt: skip
    run = {"schedule": "zbv", "package": "plans/04/vgg16/gpus=2", "stages": stages}
    assert device_memory(run) == [300, 120, None, None]
    assert memory_ratios(run) == [1.0, 1.0, None, None]
    alone = {"schedule": "1f1b", "package": "plans/01/vgg16/gpus=2", "stages": stages[:2]}
    assert memory_ratios(alone) == [3.0, 2.4]
