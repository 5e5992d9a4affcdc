"""Fixed per-call times: the line through two batch sizes, and what the profiler records."""

from __future__ import annotations

import pytest

from partitioner.graph import SPLIT_CALL
from partitioner.profiler.fixed import fit_fixed, sizes_of, small_batch
from partitioner.profiler.measure import LayerCost
from partitioner.profiler.profile import profile_model


def _cost(forward: float, backward: float) -> LayerCost:
    return LayerCost(forward, backward, 0, 0)


def test_the_line_through_two_batches_gives_the_fixed_time() -> None:
    # t(n) = 0.5 + 0.25 n forward, 1.0 + 0.5 n backward, seen at 32 and 4 samples
    fixed = fit_fixed(_cost(0.5 + 8.0, 1.0 + 16.0), _cost(0.5 + 1.0, 1.0 + 2.0), 32, 4)
    assert fixed == pytest.approx((0.5, 1.0))


def test_noise_cannot_make_a_fixed_time_negative_or_more_than_the_call() -> None:
    assert fit_fixed(_cost(10.0, 10.0), _cost(0.5, 0.5), 8, 1) == (0.0, 0.0)  # super-linear: none
    assert fit_fixed(_cost(1.0, 1.0), _cost(2.0, 2.0), 8, 1) == (2.0, 2.0)  # slower when smaller


def test_the_small_batch_is_an_eighth() -> None:
    assert [small_batch(b) for b in (1, 2, 8, 32, 100)] == [None, 1, 1, 4, 12]


def test_the_sizes_are_the_halvings_down_to_the_eighth() -> None:
    assert [sizes_of(b) for b in (1, 2, 8, 64, 100)] == [[], [1], [4, 2, 1], [32, 16, 8], [50, 25, 12]]


def test_profile_records_each_layers_fixed_time_and_how() -> None:
    profile = profile_model("tiny-mlp", batch_size=16, repeats=1)
    assert profile.extra["fixed_cost"] == {"small_batch": 2, "sizes": [16, 8, 4, 2]}
    layers = profile.layers
    assert any(n.forward_fixed_ms > 0 for n in layers)
    assert all(n.forward_fixed_ms >= 0 and n.backward_fixed_ms >= 0 for n in layers)
    # every layer at every size, the batch's own times first; a linear's backward timed as B and W
    assert all([e.samples for e in n.sized] == [16, 8, 4, 2] for n in layers)
    assert all((n.sized[0].forward_ms, n.sized[0].backward_ms) == (n.forward_ms, n.backward_ms)
               for n in layers)  # fmt: skip
    linear = [n for n in layers if n.target == "Linear"]
    assert linear and all(e.weight_ms > 0 for n in linear for e in n.sized)
    # one B call's fixed time, which each layer's timed B holds and a stage pays once: a part of B
    assert 0 < profile.extra[SPLIT_CALL] < max(e.input_ms for n in linear for e in n.sized)
    off = profile_model("tiny-mlp", batch_size=16, repeats=1, fixed_cost=False)
    assert SPLIT_CALL not in off.extra
    assert "no-fixed-cost" in off.extra["fixed_cost"]["skipped"]
    assert not any(n.forward_fixed_ms or n.backward_fixed_ms or n.sized for n in off.nodes)
