"""A layer's times at its measured microbatch sizes: interpolated, priced per microbatch, stored."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.errors import ProfileFormatError
from partitioner.graph import (
    Node,
    Profile,
    at_microbatches,
    profile_from_json,
    profile_to_json,
    split_backward,
)
from partitioner.optimizer.pricing.recompute import recomputing
from partitioner.sized import SizedCost, at_size

# a curve no line through two of its points follows: 64 -> 0.40, 16 -> 0.24, 8 -> 0.14 ms a call
CURVE = (SizedCost(64, 0.40, 0.80, 0.5, 0.4), SizedCost(16, 0.24, 0.44, 0.3, 0.2), SizedCost(8, 0.14, 0.30))


def test_a_measured_size_is_its_own_time() -> None:
    assert at_size(CURVE, 16) == SizedCost(16, 0.24, 0.44, 0.3, 0.2)


def test_between_two_sizes_the_line_through_them() -> None:
    mid = at_size(CURVE, 40)
    assert (mid.forward_ms, mid.backward_ms) == pytest.approx((0.32, 0.62))
    assert (mid.input_ms, mid.weight_ms) == pytest.approx((0.4, 0.3))
    assert not at_size(CURVE, 12).split  # the size of 8 timed no split


def test_beyond_the_sizes_the_line_through_the_two_nearest_never_below_zero() -> None:
    assert at_size(CURVE, 128).forward_ms == pytest.approx(0.40 + 64 * 0.16 / 48)
    assert at_size(CURVE, 1).forward_ms == pytest.approx(max(0.0, 0.14 - 7 * 0.1 / 8))
    assert at_size((SizedCost(8, 1.0, 2.0),), 4) == SizedCost(4, 0.5, 1.0)


def _profile() -> Profile:
    nodes = (
        Node("x", "x", "input", ""),
        Node("a", "a", "call_module", "Linear", ("x",), 0.40, 0.80, forward_fixed_ms=0.1, sized=CURVE),
        Node("b", "b", "call_module", "Linear", ("a",), 0.40, 0.80, forward_fixed_ms=0.1),
    )
    return Profile(nodes, batch_size=64)


def test_a_microbatch_is_priced_at_its_own_size() -> None:
    at = {n.id: n for n in at_microbatches(_profile(), 4).nodes}
    # 4 calls of 16 samples, as measured, where the line through 64 and 8 would give 4 x 0.18
    assert (at["a"].forward_ms, at["a"].backward_ms) == pytest.approx((4 * 0.24, 4 * 0.44))
    assert at["a"].split_ms == pytest.approx((4 * 0.3, 4 * 0.2))
    assert at["b"].forward_ms == pytest.approx(0.40 + 3 * 0.1)  # no sizes: the fixed time per call
    again = {n.id: n for n in at_microbatches(at_microbatches(_profile(), 4), 4).nodes}
    assert again["a"] == at["a"]  # idempotent


def test_a_split_backward_costs_its_measured_b_and_w() -> None:
    split = {n.id: n for n in split_backward(at_microbatches(_profile(), 4)).nodes}
    assert split["a"].backward_ms == pytest.approx(4 * 0.5)
    assert split["b"].backward_ms == pytest.approx(0.80)  # not timed apart: as it was


def test_sizes_survive_profile_json_and_bad_ones_are_refused() -> None:
    doc = profile_to_json(_profile())
    assert doc["nodes"][1]["sized"][0] == [64, 0.40, 0.80, 0.5, 0.4]
    assert "sized" not in doc["nodes"][2] and "split_ms" not in doc["nodes"][1]
    assert profile_from_json(doc).nodes[1].sized == CURVE
    doc["nodes"][1]["sized"][0][1] = -1.0
    with pytest.raises(ProfileFormatError, match=r"sized|forward"):
        profile_from_json(doc)


def test_what_the_times_hold_beyond_their_calls_stays_once_a_minibatch() -> None:
    """The optimizer's update (``with_update_time``: on the backward, once a minibatch) is kept, on
    W where the backward is split; a recomputing search's profile keeps its forward run again."""
    profile = _profile()
    nodes = (profile.nodes[0], replace(profile.nodes[1], backward_ms=0.80 + 0.5), profile.nodes[2])
    at = at_microbatches(replace(profile, nodes=nodes), 4).nodes[1]
    assert at.backward_ms == pytest.approx(4 * 0.44 + 0.5)
    assert at.split_ms == pytest.approx((4 * 0.3, 4 * 0.2 + 0.5))
    again = at_microbatches(recomputing(_profile()), 4).nodes[1]
    assert again.backward_ms == pytest.approx(4 * (0.44 + 0.24))
    assert again.split_ms == pytest.approx((4 * (0.3 + 0.24), 4 * 0.2))
