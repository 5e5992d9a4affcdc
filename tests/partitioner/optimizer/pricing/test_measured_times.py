"""A plan priced from the profile's measured microbatch sizes and split backward (``Node.sized``):
the closed forms the searches rank by and the simulation of the runtime's lists that prices the
plan charge the same per-microbatch times, with and without the runtime's time per action."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.graph import SPLIT_CALL, Node, Profile
from partitioner.optimizer import evaluate
from partitioner.optimizer.pricing.simulate import simulate
from partitioner.plan import Cluster, Link, plan_from_json, plan_to_json
from partitioner.sized import SizedCost
from tests.partitioner.optimizer.conftest import searched_s

FAST = 1e15  # bytes/s: the cut's bytes cost nothing
# per call: 8 samples 8 + 14 ms, 2 samples 3 + 5 ms (not a quarter: small calls are dearer), the
# split backward at 2 samples B 4 + W 2 ms, more than the fused 5
SIZES = (
    SizedCost(8, 8.0, 14.0, 10.0, 6.0),
    SizedCost(4, 5.0, 8.0, 6.0, 3.0),
    SizedCost(2, 3.0, 5.0, 4.0, 2.0),
)


def _chain(stages: int) -> Profile:
    """``stages`` equal layers measured at 8, 4 and 2 samples, a batch of 8; their flat times are
    the batch's own (what a profile without sizes would price in proportion)."""
    nodes = [Node("x", "x", "input", "Input", output_bytes=1)]
    for i in range(stages):
        inputs = (f"l{i - 1}",) if i else ("x",)
        nodes.append(Node(f"l{i}", f"l{i}", "call_module", "Linear", inputs, 8.0, 14.0, 1, 1, 0, sized=SIZES))
    return Profile(tuple(nodes), model="toy", batch_size=8)


def _cluster(gpus: int, action: float = 0.0) -> Cluster:
    return replace(Cluster.flat(gpus, Link(FAST)), action_s=action)


def test_1f1b_prices_the_microbatch_it_runs() -> None:
    """Two stages, M = 4: a microbatch of 2 samples costs 3 + 5 ms a stage (not 22/4), so the plan
    takes (M + p - 1)(f + b) = 5 x 8 ms, in the closed form and the simulation; its stages' compute
    is 4 calls' worth, 32 ms."""
    profile = _chain(2)
    plan = evaluate(profile, _cluster(2), ["l0"], [1, 1], "1f1b", 4)
    assert [s.compute_s for s in plan.stages] == pytest.approx([0.032, 0.032])
    assert searched_s(plan) == pytest.approx(0.040)
    assert simulate(plan, profile).time_per_minibatch_s == pytest.approx(0.040)
    assert plan.predicted.time_per_minibatch_s == pytest.approx(0.040)
    whole = evaluate(profile, _cluster(2), ["l0"], [1, 1], "1f1b", 1)  # one call of 8 samples
    assert whole.predicted.time_per_minibatch_s == pytest.approx(0.044)


@pytest.mark.parametrize("action", [0.0, 1e-3])
def test_zb1p_prices_b_and_w_as_measured(action: float) -> None:
    """Four stages, M = 4, per microbatch F 3, B 4, W 2 ms (B + W: the split's 6, not the fused 5),
    the first stage's backward all W (it has no input gradient to make). The closed form: the
    busiest stage's M(F + B + W) plus the others' (F + B - W) each, 4 x 9 + 3 x 5 = 51 ms; with a
    time per action o each of the three actions a microbatch pays it, B and W one each. The
    simulation of the runtime's lists, which prices the plan, plays the same: 51 and 66 ms."""
    profile = _chain(4)
    plan = evaluate(profile, _cluster(4, action), ["l0", "l1", "l2"], [1] * 4, "zb1p", 4)
    assert [s.compute_s for s in plan.stages] == pytest.approx([0.036] * 4)
    o = action
    closed = 4 * (0.009 + 3 * o) + 3 * (0.005 + o)
    assert searched_s(plan) == pytest.approx(closed)
    sim = simulate(plan, profile).time_per_minibatch_s
    assert sim == pytest.approx(plan.predicted.time_per_minibatch_s)
    assert sim == pytest.approx(closed)


def test_zbv_closed_form_is_a_bound_on_its_simulation_with_measured_times() -> None:
    """zbv's lower bound (75 ms here) stays below the simulation that prices the plan (76 ms)."""
    profile = _chain(4)
    plan = evaluate(profile, _cluster(2), ["l0", "l1", "l2"], [1] * 4, "zbv", 4)
    sim = simulate(plan, profile).time_per_minibatch_s
    assert searched_s(plan) <= sim + 1e-12
    assert sim == pytest.approx(plan.predicted.time_per_minibatch_s)
    # each stage: 4 microbatches of F 3 + B + W 6 ms
    assert [s.compute_s for s in plan.stages] == pytest.approx([0.036] * 4)


def test_a_split_stage_pays_one_b_call_not_one_a_layer() -> None:
    """The profile's fixed time of a B call (``SPLIT_CALL``, 1 ms here) is taken off every layer's
    timed B (4 -> 3 ms), which each paid it: zb1p's closed form and simulation price the same
    lighter stages, 4 x (3 + 3 + 2) ms of compute each and 4 x 8 + 3 x 4 = 44 ms a minibatch."""
    profile = replace(_chain(4), extra={SPLIT_CALL: 1.0})
    plan = evaluate(profile, _cluster(4), ["l0", "l1", "l2"], [1] * 4, "zb1p", 4)
    assert [s.compute_s for s in plan.stages] == pytest.approx([0.032] * 4)
    assert searched_s(plan) == pytest.approx(0.044)
    assert simulate(plan, profile).time_per_minibatch_s == pytest.approx(0.044)
    two = replace(_chain(2), extra={SPLIT_CALL: 1.0})
    fused = evaluate(two, _cluster(2), ["l0"], [1, 1], "1f1b", 4)  # the fused backward keeps its time
    assert fused.predicted.time_per_minibatch_s == pytest.approx(0.040)


def test_a_schedule_s_own_time_per_action_prices_its_plans_only() -> None:
    """A cluster whose zb1p ranks were timed apart (``schedule_action_s``) prices a zb1p plan with
    that figure, in the closed form and the simulation alike (66 ms, as with a 1 ms ``action_s``),
    and a 1f1b plan without it."""
    profile = _chain(4)
    cluster = replace(_cluster(4), schedule_action_s=(("zb1p", 1e-3),))
    plan = evaluate(profile, cluster, ["l0", "l1", "l2"], [1] * 4, "zb1p", 4)
    assert searched_s(plan) == pytest.approx(0.066)
    assert simulate(plan, profile).time_per_minibatch_s == pytest.approx(0.066)
    assert plan_from_json(plan_to_json(plan)).cluster == plan.cluster  # plan.json keeps the figures
    other = evaluate(_chain(2), cluster, ["l0"], [1, 1], "1f1b", 4)
    assert other.predicted.time_per_minibatch_s == pytest.approx(0.040)
