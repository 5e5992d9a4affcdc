"""The like-for-like comparison's pieces: pairs run back to back with the order alternating, one
timing window for both runtimes, the headline a median of per-round ratios, and a torch rank that
trains on the package's own layout as pipeplan's ranks do."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_zbv import write_zbv
from benchmarks.peers import (
    TORCH_SCHEDULES,
    median_ratio,
    paired,
    round_order,
    run_pipeplan,
    run_torch,
    step_window,
)


def test_each_pair_runs_back_to_back_and_the_order_alternates() -> None:
    pairs = [("a", "A"), ("b", "B")]
    assert round_order(pairs, 0) == ["a", "A", "b", "B"]
    assert round_order(pairs, 1) == ["B", "b", "A", "a"]
    for r in range(4):  # every pair adjacent in every round
        order = round_order(pairs, r)
        assert all(abs(order.index(x) - order.index(y)) == 1 for x, y in pairs)


def test_step_window_is_the_slower_rank_per_step_after_warmup() -> None:
    assert step_window([[9.0, 1.0, 4.0], [0.0, 2.0, 3.0]], warmup=1) == [2.0, 4.0]


def test_the_headline_is_the_median_of_per_round_ratios_not_a_ratio_of_medians() -> None:
    """Rounds 2/1, 2/4 (slow round for ours), 6/3: per round 2, 0.5, 2 -> median 2; the ratio of the
    medians (3 over 2) would say 1.5."""
    times = [(1.0, 2.0), (4.0, 2.0), (3.0, 6.0)]
    rounds = [{"ours": {"s_per_minibatch": o}, "theirs": {"s_per_minibatch": t}} for o, t in times]
    assert paired(rounds, "ours", "theirs") == [2.0, 0.5, 2.0]
    assert median_ratio(paired(rounds, "ours", "theirs")) == 2.0
    assert median_ratio([]) is None


def test_paired_skips_rounds_where_either_failed() -> None:
    rounds = [
        {"ours": {"s_per_minibatch": 2.0}, "theirs": {"s_per_minibatch": 3.0}},
        {"ours": {"error": "x"}, "theirs": {"s_per_minibatch": 3.0}},
    ]
    assert paired(rounds, "ours", "theirs") == [1.5]


def test_each_schedule_compared_has_a_torch_counterpart() -> None:
    from torch.distributed.pipelining import schedules

    for ours in ("1f1b", "gpipe", "zb1p", "interleaved", "zbv"):
        assert hasattr(schedules, TORCH_SCHEDULES[ours])


@pytest.mark.slow
def test_torch_trains_the_same_weights_as_pipeplan(tmp_path: Path) -> None:
    """The same stages, minibatches, loss scaling and optimizer: after 3 steps both runtimes hold the
    same weights (sum of squares per rank), so the benchmarks time the same work. zbv: two stages per
    rank, the first rank feeding the inputs and the targets. (Checked once on gpipe, zb1p and
    interleaved too; one schedule here keeps the suite fast.)"""
    package = write_zbv(tmp_path / "pkg", width=16, layers=4, batch=8, micro=2)
    theirs = run_torch(package, "zbv", steps=3, micro=2, warmup=1)
    _, metrics = run_pipeplan(package, "zbv", steps=3, micro=2, warmup=1)
    assert len(theirs["steps_s"]) == 2 and theirs["s_per_minibatch"] > 0
    ours = [r["param_sq_sum"] for r in sorted(metrics["ranks"], key=lambda r: r["rank"])]
    assert theirs["param_sq_sum"] == pytest.approx(ours, rel=1e-5)
