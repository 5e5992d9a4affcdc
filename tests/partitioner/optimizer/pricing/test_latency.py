"""The alpha-beta link: every message pays the link's latency, in the closed forms, the searches and
the simulation alike, and a schedule that sends more messages pays for more of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.optimizer import evaluate, solve
from partitioner.optimizer.pricing.schedules import MODELS, model
from partitioner.optimizer.pricing.simulate import simulate
from partitioner.optimizer.pricing.stage import activation_time, allreduce_time, microbatch_link, stage_time
from partitioner.plan import Cluster, Link, Plan
from tests.partitioner.optimizer.conftest import make_profile, searched_s

A = 1e-3  # the latency of the hand-checked cases: 1 ms a message
FAST = 1e15  # bytes/s: the bytes cost nothing, so the extra time is the messages' alone


def test_stage_functions_charge_one_latency_per_message() -> None:
    link = Link(1e9, A)
    assert activation_time(1e6, 1, link) == pytest.approx(2e-3 + 2 * A)  # out and back
    assert activation_time(1e6, 2, link) == pytest.approx((2e-3 + 2 * A) / 2)  # every other minibatch
    assert activation_time(0.0, 1, link) == 0.0  # nothing crosses: no message
    assert microbatch_link(1e6, 1, 4, link) == pytest.approx(2e-3 / 4 + 2 * A)  # each microbatch its own
    assert allreduce_time(0.0, 4, link) == pytest.approx(2 * 3 * A)  # a ring: 2(r-1) steps
    assert allreduce_time(1e6, 1, link) == 0.0
    assert float(stage_time(0.030, 0.0, 1, Link(FAST, 0.020), act=1.0)) == pytest.approx(0.040)


def _chain(stages: int) -> object:
    """``stages`` equal layers of 10 ms forward, 20 ms backward, one byte out, no parameters."""
    return make_profile([(10, 20, 1, 0)] * stages, [(i, i + 1) for i in range(stages - 1)])


def _priced(schedule: str, p: int, m: int, latency: float) -> tuple[Plan, float]:
    """The plan of one layer per stage on p ranks (2p stages for interleaved and zbv), and its simulation."""
    v = 2 if schedule in ("interleaved", "zbv") else 1
    profile = _chain(p * v)
    extra = {"virtual_stages": v} if schedule == "interleaved" else {}
    cuts = [f"l{i}" for i in range(p * v - 1)]
    plan = evaluate(profile, Cluster.flat(p, Link(FAST, latency)), cuts, [1] * (p * v), schedule, m, **extra)
    sim = simulate(plan, profile, minibatches=40 if schedule == "pipedream" else None)
    return plan, sim.time_per_minibatch_s


@pytest.mark.parametrize(
    ("schedule", "closed", "simulated"),
    [
        # the flushing schedules' closed form charges a microbatch's messages on its stage: sum of
        # one microbatch's stages (stage 0: out and back, 2a) + (M-1) x the slowest (2a) = 4a; the
        # simulation plays them as delays, and only the fill and drain wait on them: one each way.
        # The plan's price is the simulation's; the closed form only ranks plans in the search
        ("1f1b", 4 * A, 2 * A),
        ("gpipe", 4 * A, 2 * A),
        # zb1p: W fills the wait; one message each way on the critical path, in both
        ("zb1p", 2 * A, 2 * A),
        # interleaved: stages 0..3 on ranks 0,1,0,1, three rank changes forward and three back
        ("interleaved", 6 * A, 6 * A),
        # zbv: stages 0..3 on ranks 0,1,1,0, two rank changes each way in the simulation; its
        # closed form, a lower bound, sees the busiest rank's fill (one hop) alone
        ("zbv", 1 * A, 4 * A),
    ],
)
def test_hand_checked_extra_time_per_schedule(schedule: str, closed: float, simulated: float) -> None:
    """p = 2, M = 2, equal 30 ms stages, free bytes: the extra time is counted messages x 1 ms, the
    closed form's and the simulation's; the plan predicts the simulation's."""
    plan0, sim0 = _priced(schedule, 2, 2, 0.0)
    plan1, sim1 = _priced(schedule, 2, 2, A)
    assert searched_s(plan1) - searched_s(plan0) == pytest.approx(closed)
    assert sim1 - sim0 == pytest.approx(simulated)
    assert plan1.predicted.time_per_minibatch_s - plan0.predicted.time_per_minibatch_s == pytest.approx(
        simulated
    )


@pytest.mark.parametrize(
    ("schedule", "messages"),
    [
        # p = 2, equal stages f = 10, b = 20 ms, a = 1 ms a message. 1F1B: the steady state waits on
        # one message a microbatch (stage 1's next forward needs stage 0's, sent after stage 0's
        # backward, which needed stage 1's gradient): M messages in all
        ("1f1b", lambda m: m),
        # GPipe: every forward streams, then every backward; only the first trip's two messages
        # (fill: one forward, drain: one gradient) are on the critical path, whatever M
        ("gpipe", lambda m: 2),
    ],
)
@pytest.mark.parametrize("m", [2, 4, 8, 16])
def test_hand_checked_latency_over_microbatches(
    schedule: str, messages: Callable[[int], int], m: int
) -> None:
    """The plan's latency term, worked out by hand for two equal stages, as M grows."""
    plan0, _ = _priced(schedule, 2, m, 0.0)
    plan1, _ = _priced(schedule, 2, m, A)
    extra = plan1.predicted.time_per_minibatch_s - plan0.predicted.time_per_minibatch_s
    assert extra == pytest.approx(messages(m) * A)


def test_hand_checked_pipedream() -> None:
    """Two 30 ms stages: a cut's message out and back (20 ms each) makes the stage 40 ms; a stage on
    2 replicas all-reduces in 2 steps of 1 ms each, (30 + 2)/2 = 16 ms, against 15 ms."""
    profile = _chain(2)
    slow = evaluate(profile, Cluster.flat(2, Link(FAST, 0.020)), ["l0"], [1, 1])
    assert slow.predicted.time_per_minibatch_s == pytest.approx(0.040)
    one = make_profile([(10, 20, 1, 1000)], [])
    wide = evaluate(one, Cluster.flat(2, Link(FAST, A)), [], [2])
    assert wide.predicted.time_per_minibatch_s == pytest.approx((0.030 + 2 * A) / 2)
    assert simulate(wide, one, minibatches=40).time_per_minibatch_s == pytest.approx((0.030 + 2 * A) / 2)


def test_more_microbatches_pay_more_messages() -> None:
    """Each microbatch sends its own activation and gradient: at 1 ms a message, the search's closed
    form charges 1f1b at M = 8 6 x 2 ms more than at M = 2 would in bytes alone (so the optimizer
    weighs it), and the plan's price, the simulation's, 6 x 1 ms."""
    plans = {m: _priced("1f1b", 2, m, A)[0] for m in (2, 8)}
    free = {m: _priced("1f1b", 2, m, 0.0)[0] for m in (2, 8)}
    searched = {m: searched_s(plans[m]) - searched_s(free[m]) for m in (2, 8)}
    extra = {
        m: plans[m].predicted.time_per_minibatch_s - free[m].predicted.time_per_minibatch_s for m in (2, 8)
    }
    assert searched[8] - searched[2] == pytest.approx(6 * 2 * A)
    assert extra[8] - extra[2] == pytest.approx(6 * A)


dags = st.integers(min_value=2, max_value=6).flatmap(
    lambda n: st.lists(
        st.tuples(st.integers(1, 20), st.integers(1, 40), st.integers(1, 4000), st.integers(0, 3000)),
        min_size=n,
        max_size=n,
    )
)


@settings(max_examples=25, deadline=None)
@given(
    costs=dags,
    schedule=st.sampled_from(sorted(MODELS)),
    gpus=st.integers(1, 3),
    latency=st.sampled_from([1e-4, 1e-3, 5e-3]),
    action=st.sampled_from([0.0, 1e-3]),
)
def test_searched_plans_are_priced_as_their_closed_form_and_simulation(
    costs: list[tuple[int, int, int, int]], schedule: str, gpus: int, latency: float, action: float
) -> None:
    """Random chains, every schedule, a nonzero latency, with or without the runtime's time per
    action: the searched plan's price is what the plan cost model gives its stages again (the
    vectorised search charged the same messages and actions as the closed form), and for every
    flushing schedule what the simulation gives."""
    profile = make_profile(costs, [(i, i + 1) for i in range(len(costs) - 1)])
    cluster = replace(Cluster.flat(gpus, Link(1e6, latency)), action_s=action)
    sched = model(schedule)
    m = 1 if sched.asynchronous else 2 * gpus
    v = 2 if sched.laid_out else 1
    if sched.laid_out and (gpus < 2 or len(costs) < gpus * v):
        return  # a layer per stage at least, and two ranks to pass a microbatch between
    extra = {"virtual_stages": v} if schedule == "interleaved" else {}
    plan = solve(profile, cluster, schedule, m, **extra)
    cuts = [s.nodes[-1] for s in plan.stages[:-1]]
    again = evaluate(
        profile, cluster, cuts, [s.replicas for s in plan.stages], schedule, plan.microbatches, **extra
    )
    assert again.predicted.time_per_minibatch_s == pytest.approx(
        plan.predicted.time_per_minibatch_s, rel=1e-9
    )
    if sched.simulated:  # every flushing schedule: the plan predicts what the simulation plays
        sim = simulate(plan, profile)
        assert sim.time_per_minibatch_s == pytest.approx(plan.predicted.time_per_minibatch_s, rel=1e-9)
    if action:  # and it pays for its actions
        reps = [s.replicas for s in plan.stages]
        unpriced = replace(cluster, action_s=0.0)
        free = evaluate(profile, unpriced, cuts, reps, schedule, plan.microbatches, **extra)
        assert plan.predicted.time_per_minibatch_s > free.predicted.time_per_minibatch_s


def test_a_cut_moves_one_message_at_a_time() -> None:
    """GPipe, two stages of 1 ms forward and 2 ms backward a minibatch, M = 4, a cut of 1000 bytes
    at 100 kB/s (2.5 ms a microbatch each way) and no latency. Worked by hand: the forwards leave
    stage 0 at 0.25, 0.5, 0.75 and 1 ms and cross one after another (arriving 2.75, 5.25, 7.75,
    10.25); stage 1 ends its last forward at 10.5 and its backwards at 11, 11.5, 12, 12.5; their
    gradients cross one after another too (13.5, 16, 18.5, 21) and stage 0's last backward ends at
    21.5 ms. A pure delay would let every message cross at once (8.75 ms)."""
    profile = make_profile([(1, 2, 1000, 0), (1, 2, 1, 0)], [(0, 1)])
    plan = evaluate(profile, Cluster.flat(2, Link(1e5, 0.0)), ["l0"], [1, 1], "gpipe", 4)
    assert simulate(plan, profile).time_per_minibatch_s == pytest.approx(0.0215)
    assert plan.predicted.time_per_minibatch_s == pytest.approx(0.0215)


@pytest.mark.parametrize(("schedule", "messages"), [("interleaved", 3), ("zbv", 2), ("1f1b", 1)])
def test_cuts_between_the_same_ranks_share_their_wire(schedule: str, messages: int) -> None:
    """Four stages of 3 ms, 1000 bytes a cut at 100 kB/s (10 ms a minibatch one way), no latency:
    a direction between two ranks carries its messages one after another, so a minibatch takes at
    least the busiest direction's bytes. interleaved (stages on ranks 0,1,0,1): rank 0 sends
    rank 1 the forwards of cuts 0 and 2 and the gradient of cut 1, 30 ms; zbv (0,1,1,0): a
    forward and a gradient each way, 20 ms; 1f1b on 4 ranks: one cut a direction, 10 ms."""
    gpus = 4 if schedule == "1f1b" else 2
    profile = make_profile([(1, 2, 1000, 0)] * 4, [(i, i + 1) for i in range(3)])
    extra = {"virtual_stages": 2} if schedule == "interleaved" else {}
    cluster = Cluster.flat(gpus, Link(1e5, 0.0))
    plan = evaluate(profile, cluster, ["l0", "l1", "l2"], [1] * 4, schedule, 4, **extra)
    assert plan.predicted.time_per_minibatch_s >= messages * 0.010
