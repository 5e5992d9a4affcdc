"""The microbatch benchmark's own arithmetic: regret and the profile without fixed times."""

from __future__ import annotations

import pytest

from benchmarks.bench_microbatches import regret, without_fixed


def test_regret_is_the_measured_time_at_the_predicted_pick_over_the_best() -> None:
    assert regret([3.0, 1.0, 2.0], [10.0, 20.0, 15.0]) == pytest.approx(2.0)  # picks the second
    assert regret([1.0, 2.0], [5.0, 6.0]) == 1.0


def test_without_fixed_zeroes_only_the_fixed_times() -> None:
    doc = {
        "schema": "s",
        "nodes": [{"id": "a", "forward_ms": 2.0, "forward_fixed_ms": 0.5, "backward_fixed_ms": 1.0}],
    }
    out = without_fixed(doc)
    assert out["nodes"] == [{"id": "a", "forward_ms": 2.0, "forward_fixed_ms": 0.0, "backward_fixed_ms": 0.0}]
    assert out["schema"] == "s" and doc["nodes"][0]["forward_fixed_ms"] == 0.5  # the input is left alone
