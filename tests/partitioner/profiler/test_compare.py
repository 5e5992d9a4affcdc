"""compare: an estimate against a measurement of the same model, per layer and in total."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.errors import PipeplanError
from partitioner.profiler.compare import compare, spread
from tests.partitioner.optimizer.conftest import make_profile

COSTS = [(5, 10, 4000, 1000), (8, 16, 2000, 2000), (3, 6, 1000, 50), (9, 18, 500, 3000)]


def test_ratios_spread_and_the_worst_layers() -> None:
    measured = replace(make_profile(COSTS, [(0, 1), (1, 2), (2, 3)]), step_ms=60.0)
    factors = {"l0": 0.5, "l1": 1.0, "l2": 2.0, "l3": 1.0}
    estimated = replace(
        measured,
        nodes=tuple(
            replace(
                n,
                forward_ms=n.forward_ms * factors.get(n.id, 1),
                backward_ms=n.backward_ms * factors.get(n.id, 1),
            )
            for n in measured.nodes
        ),
        step_ms=None,
    )
    report = compare(measured, estimated)
    assert report["layers"] == 4 and report["total"]["median"] == pytest.approx(1.0)
    assert report["total"]["p10"] == 0.5 and report["total"]["p90"] == 2.0
    assert report["sum_measured_ms"] == pytest.approx(75.0)
    assert report["sum_ratio"] == pytest.approx((7.5 + 24 + 18 + 27) / 75)
    assert report["step_ratio"] == pytest.approx((7.5 + 24 + 18 + 27) / 60)
    assert report["worst"][0]["id"] == "l0"  # 15 ms off by 2x outweighs 9 ms off by 2x
    # a batch twice as large is rescaled before comparing
    doubled = compare(replace(measured, batch_size=16), estimated)
    assert doubled["total"]["median"] == pytest.approx(2.0)


def test_layers_pair_by_name_when_ids_differ_and_unrelated_profiles_fail() -> None:
    measured = make_profile(COSTS, [(0, 1), (1, 2), (2, 3)])
    nodes = tuple(
        replace(n, id=f"{n.id}_x", inputs=tuple(f"{i}_x" for i in n.inputs)) for n in measured.nodes
    )
    renamed = replace(measured, nodes=nodes)
    assert compare(measured, renamed)["layers"] == 4
    other = replace(renamed, nodes=tuple(replace(n, name=f"other{n.name}") for n in renamed.nodes))
    with pytest.raises(PipeplanError, match="share no layers"):
        compare(measured, other)
    assert spread([])["median"] is None
