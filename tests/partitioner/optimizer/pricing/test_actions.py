"""The runtime's time per action (``Cluster.action_s``): every forward, backward and W pays it, in
the closed forms the searches rank by, the simulation that prices the plan and the searches alike,
so a plan of more stages or microbatches pays for its actions and the choice moves with it (random
plans of every schedule with a time per action: ``test_latency.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.errors import PlanError
from partitioner.optimizer import evaluate, solve
from partitioner.optimizer.pricing.schedules import model
from partitioner.optimizer.pricing.simulate import simulate, stage_bubbles
from partitioner.plan import Cluster, Link
from tests.partitioner.optimizer.conftest import make_profile, searched_s

A = 1e-3  # the hand-checked cases' time per action: 1 ms
FAST = 1e15  # bytes/s: the cut's bytes cost nothing


def _chain(stages: int, params: int = 0) -> object:
    """``stages`` equal layers of 10 ms forward and 20 ms backward a minibatch, one byte out."""
    return make_profile([(10, 20, 1, params)] * stages, [(i, i + 1) for i in range(stages - 1)])


def _cluster(gpus: int, action: float, link: Link | None = None) -> Cluster:
    return replace(Cluster.flat(gpus, link or Link(FAST)), action_s=action)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_hand_checked_flushing_schedules(schedule: str) -> None:
    """Two equal stages, M = 2, f = 5 and b = 10 ms a microbatch. Both schedules run stage 0's
    forwards, stage 1's four actions and stage 0's backwards one after another: 3f + 3b, and with
    1 ms an action 3(f + o) + 3(b + o), 6 ms more, in the simulation and the closed form alike
    (sum of one microbatch's stages + (M - 1) x the slowest: 2 x 2o + 2o)."""
    profile = _chain(2)
    plans = {a: evaluate(profile, _cluster(2, a), ["l0"], [1, 1], schedule, 2) for a in (0.0, A)}
    assert plans[0.0].predicted.time_per_minibatch_s == pytest.approx(0.045)
    assert plans[A].predicted.time_per_minibatch_s == pytest.approx(0.045 + 6 * A)
    assert searched_s(plans[A]) - searched_s(plans[0.0]) == pytest.approx(6 * A)
    assert simulate(plans[A], profile).time_per_minibatch_s == pytest.approx(0.045 + 6 * A)
    # a stage's compute stays its layers' (what `run` measures as compute)
    assert [s.compute_s for s in plans[A].stages] == [s.compute_s for s in plans[0.0].stages]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_time_per_action_is_idle_in_the_bubble(schedule: str) -> None:
    """``run`` times the layers' spans as compute, so the simulated bubble counts the time per
    action as idle: the case above's stage 1 computes 30 ms of its 45 + 6 ms span (its four actions
    carry 4 ms), stage 0 the same."""
    profile = _chain(2)
    plan = evaluate(profile, _cluster(2, A), ["l0"], [1, 1], schedule, 2)
    span = 0.045 + 6 * A
    sim = simulate(plan, profile)
    assert stage_bubbles(plan, sim) == pytest.approx([1 - 0.030 / span] * 2)
    assert sim.bubble_fraction == pytest.approx(1 - 0.030 / span)


def test_hand_checked_pipedream() -> None:
    """A pipedream stage runs a forward and a backward a minibatch: two 30 ms stages take 32 ms; one
    stage of both layers on 2 replicas, each replica every other minibatch, (60 + 2)/2 = 31 ms."""
    profile = _chain(2)
    two = evaluate(profile, _cluster(2, A), ["l0"], [1, 1])
    assert two.predicted.time_per_minibatch_s == pytest.approx(0.032)
    wide = evaluate(profile, _cluster(2, A), [], [2])
    assert wide.predicted.time_per_minibatch_s == pytest.approx(0.031)
    assert simulate(wide, profile, minibatches=40).time_per_minibatch_s == pytest.approx(0.031)


def test_the_data_parallel_comparator_and_the_host_bound_pay_the_actions_too() -> None:
    """The data-parallel plan is its own comparator (speedup 1), actions and all; on one core two
    CPU ranks take turns, their actions included: 2 x (30 + 2) ms."""
    profile = _chain(2)
    wide = evaluate(profile, _cluster(2, A), [], [2])
    assert wide.predicted.speedup_vs_data_parallel == pytest.approx(1.0)
    shared = replace(_cluster(2, A), cores=1)
    assert evaluate(profile, shared, ["l0"], [1, 1]).predicted.host_bound_s == pytest.approx(0.064)


def test_a_split_backward_pays_three_actions_a_microbatch() -> None:
    """zb1p and zbv run F, B and W per microbatch: 3M actions a stage, 2M for 1f1b."""
    assert model("zb1p").actions(4) == 12 and model("zbv").actions(4) == 12
    assert model("1f1b").actions(4) == 8 and model("interleaved").actions(4) == 8
    assert model("pipedream").actions(4) == 2  # whole minibatches


def test_the_time_per_action_changes_the_plan() -> None:
    """1F1B on 2 devices, M = 4, two 30 ms layers of 5 MB weights each at 1 GB/s: without an action
    cost two stages win (37.5 ms against one stage on 2 replicas' 30 + 20 ms all-reduce); at 5 ms
    an action, 87.5 ms against 70: the two stages' 8 actions each are on every microbatch's path,
    the replicas' 8 split between them."""
    profile = _chain(2, params=5_000_000)
    link = Link(1e9)
    free = solve(profile, _cluster(2, 0.0, link), "1f1b", 4)
    costly = solve(profile, _cluster(2, 5e-3, link), "1f1b", 4)
    assert [s.replicas for s in free.stages] == [1, 1]
    assert [s.replicas for s in costly.stages] == [2]


def test_a_negative_time_per_action_is_refused() -> None:
    with pytest.raises(PlanError, match="time per action must be >= 0"):
        _cluster(2, -1e-3)
