"""zbv's cost model (closed form, memory in flight) against the event simulation of the runtime's own
lists (``runtime.schedule``'s zbv builder), and the planner's zbv plans."""

from __future__ import annotations

import random
import statistics
from itertools import pairwise

import pytest

from partitioner.errors import PlanError
from partitioner.graph import Profile
from partitioner.optimizer import evaluate, solve
from partitioner.optimizer.pricing.schedules import in_flight, zbv_time
from partitioner.optimizer.pricing.simulate import Event, play, simulate
from partitioner.optimizer.pricing.stage import W_SHARE
from partitioner.plan import Cluster, plan_from_json, plan_to_json
from runtime.schedule import build, layout_of
from tests.partitioner.optimizer.conftest import make_profile


def played(
    p: int, m: int, fwd: list[float], bwd: list[float], link: list[float], wgt: list[float]
) -> list[Event]:
    """One minibatch of zbv's lists on ``p`` GPUs, played."""
    layout = layout_of("zbv", p, 2)
    return play(build("zbv", layout, m), layout, fwd, bwd, link, wgt)[0]


CASES = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 2 * p - 1, 2 * p, 3 * p)]


def _even(stages: int) -> tuple[Profile, list[str]]:
    """``stages`` equal layers (F 10 ms, B 20 ms: B = W = F under W_SHARE 0.5), no activation
    traffic; one cut after each."""
    profile = make_profile([(10, 20, 0, 10)] * stages, [(i, i + 1) for i in range(stages - 1)])
    return profile, [f"l{i}" for i in range(stages - 1)]


@pytest.mark.parametrize(("p", "m"), CASES)
def test_equal_stages_take_the_unit_slots_of_the_lists(p: int, m: int) -> None:
    """F = B = W = t per chunk: one minibatch takes max(6m + p - 1, 4m + 4p - 2) t, the schedule's
    slots, a bubble of p - 1 slots once m >= 2p - 1; in the steady state the next minibatch's
    forwards fill those slots (each rank starts it once it has stepped), so a minibatch takes
    max(6m, 4m + 4p - 2) t, no bubble from m = 2p - 1; the plan predicts the simulation."""
    assert W_SHARE == 0.5
    profile, cuts = _even(2 * p)
    plan = evaluate(profile, Cluster.flat(p), cuts, [1] * (2 * p), "zbv", m)
    sim = simulate(plan, profile)
    t = 0.010 / m
    one = max(e.end_s for e in sim.events)  # (the first minibatch's events)
    assert one == pytest.approx(max(6 * m + p - 1, 4 * m + 4 * p - 2) * t)
    assert sim.time_per_minibatch_s == pytest.approx(max(6 * m, 4 * m + 4 * p - 2) * t)
    if m >= 2 * p - 1:
        assert sim.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    assert plan.predicted.time_per_minibatch_s == pytest.approx(sim.time_per_minibatch_s, rel=1e-12)
    assert plan.predicted.bubble_fraction == pytest.approx(sim.bubble_fraction, rel=1e-12)
    assert tuple(s.ranks for s in plan.stages) == layout_of("zbv", p, 2)
    assert plan.gpus == p and plan.virtual_stages == 2 and plan.schedule == "zbv"
    if m >= 2 * p - 1:  # the closed form is exact on equal stages
        f, b = [t] * (2 * p), [2 * t] * (2 * p)
        assert zbv_time(f, b, [0.0] * (2 * p), m) == pytest.approx(one)


def test_closed_form_is_a_lower_bound_of_the_simulation_on_unequal_stages() -> None:
    """600 random chains (unequal F and B, links): never above the simulation, median within 2%,
    all within 25%."""
    rng = random.Random(3)
    ratios = []
    for _ in range(600):
        p = rng.randint(1, 4)
        forward = [rng.uniform(0.5, 1.5) for _ in range(2 * p)]
        backward = [2 * f * rng.uniform(0.8, 1.2) for f in forward]
        link = [rng.uniform(0.0, 0.3) for _ in range(2 * p)]
        m = rng.randint(2 * p - 1, 4 * p)
        hop = [0.0 if k == p - 1 else a / 2 for k, a in enumerate(link)]  # one way, as simulate sends it
        b, w = [t * (1 - W_SHARE) for t in backward], [t * W_SHARE for t in backward]
        events = played(p, m, forward, b, hop, w)
        ratios.append(max(e.end_s for e in events) / zbv_time(forward, backward, link, m))
    assert min(ratios) >= 1 - 1e-9
    assert statistics.median(ratios) < 1.02
    assert max(ratios) < 1.25


@pytest.mark.parametrize(("p", "m"), [(1, 2), (2, 2), (2, 4), (3, 5), (4, 8), (4, 12)])
def test_memory_in_flight_is_what_the_simulation_holds(p: int, m: int) -> None:
    """Stage k holds the units its rank's list holds from F to W (2p - k once m >= 2p); every stage
    is priced with that count, as the simulation prices it."""
    n = 2 * p
    profile = make_profile([(10 + i, 20 + 2 * i, 1000 * (i + 1), 10) for i in range(n)],
                           [(i, i + 1) for i in range(n - 1)])  # fmt: skip
    plan = evaluate(profile, Cluster.flat(p), [f"l{i}" for i in range(n - 1)], [1] * n, "zbv", m)
    sim = simulate(plan, profile)
    assert sim.in_flight == tuple(in_flight("zbv", k, [1] * n, m) for k in range(n))
    if m >= 2 * p:
        assert sim.in_flight == tuple(2 * p - k for k in range(n))
    assert tuple(s.memory_bytes for s in plan.stages) == sim.peak_memory_bytes


def _random_chain(rng: random.Random, layers: int) -> Profile:
    costs = [
        (rng.randint(2, 20), rng.randint(2, 40), rng.choice([0, 2000, 8000, 30000]), 10)
        for _ in range(layers)
    ]
    return make_profile(costs, [(i, i + 1) for i in range(layers - 1)])


def test_a_plan_predicts_what_the_simulation_plays() -> None:
    """solve and evaluate alike: a zbv plan's time and bubble are the event simulation's of the
    runtime's lists, on unequal stages with links; the V layout survives plan.json."""
    rng = random.Random(4)
    for _ in range(8):
        profile, cluster = _random_chain(rng, 7), Cluster.flat(2, bandwidth=1e7)
        for plan in (
            solve(profile, cluster, "zbv", 4),
            evaluate(profile, cluster, ["l0", "l2", "l4"], [1] * 4, "zbv", 4),
        ):
            sim = simulate(plan, profile)
            assert plan.predicted.time_per_minibatch_s == pytest.approx(sim.time_per_minibatch_s, rel=1e-12)
            assert plan.predicted.bubble_fraction == pytest.approx(sim.bubble_fraction, rel=1e-12)
            assert plan.extra["priced_by"] == "simulation"
            again = plan_from_json(plan_to_json(plan))
            assert again.virtual_stages == 2 and [s.ranks for s in again.stages] == [(0,), (1,), (1,), (0,)]


def test_zbv_beats_zb1p_and_1f1b_on_equal_layers() -> None:
    """8 equal layers on 2 GPUs, 4 microbatches: half-size stages halve zb1p's bubble."""
    profile, _ = _even(8)
    zbv = solve(profile, Cluster.flat(2), "zbv", 4)
    zb1p = solve(profile, Cluster.flat(2), "zb1p", 4, straight=True)
    one = solve(profile, Cluster.flat(2), "1f1b", 4, straight=True)
    assert zbv.predicted.time_per_minibatch_s < zb1p.predicted.time_per_minibatch_s
    assert zbv.predicted.time_per_minibatch_s < one.predicted.time_per_minibatch_s


def test_bad_zbv_requests_are_refused() -> None:
    profile, cuts = _even(4)
    with pytest.raises(PlanError, match="--schedule zbv on 4 GPUs needs 8 stages"):
        solve(profile, Cluster.flat(4), "zbv", 8)
    with pytest.raises(PlanError, match="a multiple of 2 stages"):
        evaluate(profile, Cluster.flat(2), cuts[:2], [1, 1, 1], "zbv", 4)
    with pytest.raises(PlanError, match="one device each"):
        evaluate(profile, Cluster.flat(3), cuts[:1], [2, 1], "zbv", 4)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_the_last_rank_starts_after_p_minus_1_passes_and_never_idles(p: int) -> None:
    """Why the bubble is p - 1 passes (F = B = W = 1, m >= 2p - 1): rank p - 1 waits p - 1 passes
    for unit 0 to come down, then runs its 6m passes back to back and ends the minibatch."""
    for m in range(2 * p - 1, 4 * p + 2):
        events = played(p, m, [1.0] * (2 * p), [1.0] * (2 * p), [0.0] * (2 * p), [1.0] * (2 * p))
        last = sorted((e.start_s, e.end_s) for e in events if layout_of("zbv", p, 2)[e.stage] == (p - 1,))
        assert last[0][0] == p - 1
        assert all(a[1] == b[0] for a, b in pairwise(last))
        assert last[-1][1] == max(e.end_s for e in events) == 6 * m + p - 1
