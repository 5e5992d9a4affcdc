"""The optimizer update charged to each layer from the profile's measured rates."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.optimizer import evaluate
from partitioner.plan import Cluster
from partitioner.profiler.update_cost import UPDATE_KEY, update_ms, with_update_time
from tests.partitioner.optimizer.conftest import make_profile

# l0: 1 MB of weights, l1: none, l2: 2 MB
BASE = make_profile([(10, 20, 4000, 1_000_000), (5, 10, 1000, 0), (15, 30, 0, 2_000_000)], [(0, 1), (1, 2)])
RATED = replace(BASE, extra={UPDATE_KEY: {"sgd": 1e-9, "adam": 4e-9}})


def test_each_layer_pays_its_weights_bytes_at_the_optimizers_rate() -> None:
    charged = with_update_time(RATED, "adam")
    assert charged.node("l0").backward_ms == pytest.approx(20 + 1e6 * 4e-9 * 1e3)  # + 4 ms
    assert charged.node("l1") == RATED.node("l1")  # no weights, no update
    assert charged.node("l2").backward_ms == pytest.approx(30 + 8.0)
    assert charged.node("l2").forward_ms == 15
    assert update_ms(RATED, "adam") == pytest.approx(12.0) and update_ms(RATED, "sgd") == pytest.approx(3.0)


def test_charged_once_and_never_without_rates() -> None:
    once = with_update_time(RATED, "sgd")
    assert UPDATE_KEY not in once.extra and once.extra["update_charged"]["optimizer"] == "sgd"
    assert with_update_time(once, "sgd") == once  # a calibrated profile (rates absorbed) gains nothing
    assert with_update_time(BASE, "adam") == BASE  # PipeDream's graph.txt and older profiles


def test_plans_price_the_update_in_stage_compute() -> None:
    plain = evaluate(BASE, Cluster.flat(2), ["l0"], [1, 1], "pipedream", 1, "adam")
    charged = evaluate(
        with_update_time(RATED, "adam"), Cluster.flat(2), ["l0"], [1, 1], "pipedream", 1, "adam"
    )
    assert [s.compute_s for s in charged.stages] == pytest.approx(
        [s.compute_s + extra for s, extra in zip(plain.stages, (0.004, 0.008), strict=True)]
    )
