"""interleaved's cost model (closed form, memory in flight) against the event simulation of the
runtime's own lists (``runtime.schedule``'s interleaved builder), and the planner's interleaved plans."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from partitioner.errors import PlanError
from partitioner.graph import Profile
from partitioner.optimizer import evaluate, solve
from partitioner.optimizer.pricing.schedules import in_flight, interleaved_time
from partitioner.optimizer.pricing.simulate import play, simulate
from partitioner.plan import Cluster, plan_from_json, plan_to_json
from runtime.schedule import build, layout_of
from tests.partitioner.optimizer.conftest import make_profile


def _even(stages: int) -> tuple[Profile, list[str]]:
    """``stages`` equal layers (F 10 ms, B 20 ms), no activation traffic; one cut after each."""
    profile = make_profile([(10, 20, 0, 10)] * stages, [(i, i + 1) for i in range(stages - 1)])
    return profile, [f"l{i}" for i in range(stages - 1)]


# (one GPU hosts several stages only with a second GPU to send to: the runtime does not send to itself)
CASES = [(p, v, m) for p in (1, 2, 4) for v in (1, 2, 3) for m in (p, 2 * p, 3 * p) if p > 1 or v == 1]


@pytest.mark.parametrize(("p", "v", "m"), CASES)
def test_equal_stages_take_the_closed_form_bubble_p_minus_1_over_v_m(p: int, v: int, m: int) -> None:
    profile, cuts = _even(p * v)
    plan = evaluate(profile, Cluster.flat(p), cuts, [1] * (p * v), "interleaved", m, virtual_stages=v)
    sim = simulate(plan, profile)
    chunk = 0.030 / m  # one microbatch's F + B on one stage
    ideal = v * m * chunk  # one rank's work
    assert sim.time_per_minibatch_s == pytest.approx((v * m + p - 1) * chunk)
    assert sim.time_per_minibatch_s / ideal - 1 == pytest.approx((p - 1) / (v * m))
    assert plan.predicted.time_per_minibatch_s == pytest.approx(sim.time_per_minibatch_s)
    assert plan.predicted.bubble_fraction == pytest.approx(sim.bubble_fraction)
    assert [s.ranks for s in plan.stages] == [(s % p,) for s in range(p * v)]
    assert plan.gpus == p and plan.virtual_stages == v


def _random_case(rng: random.Random) -> tuple[list[float], list[float], list[float], int, int]:
    p, v = rng.randint(2, 4), rng.randint(1, 3)
    forward = [rng.uniform(0.5, 1.5) for _ in range(p * v)]
    backward = [2 * f * rng.uniform(0.8, 1.2) for f in forward]
    link = [rng.uniform(0.0, 0.3) for _ in range(p * v)]
    return forward, backward, link, p * rng.randint(1, 3), p


def test_closed_form_is_a_lower_bound_of_the_simulation_on_unequal_stages() -> None:
    """600 random chains (unequal F and B, links): never above the simulation, median within 5%,
    all within 35% (a slow stage stalls the ranks after it within each round; not charged)."""
    rng = random.Random(3)
    ratios = []
    for _ in range(600):
        forward, backward, link, m, p = _random_case(rng)
        layout = layout_of("interleaved", p, len(forward) // p)
        events, _ = play(build("interleaved", layout, m), layout, forward, backward, [a / 2 for a in link])
        ratios.append(max(e.end_s for e in events) / interleaved_time(forward, backward, link, m, p))
    assert min(ratios) >= 1 - 1e-9
    assert statistics.median(ratios) < 1.05
    assert max(ratios) < 1.35


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 2), (2, 2, 4), (4, 2, 8), (2, 3, 6), (4, 3, 4)])
def test_memory_in_flight_is_what_the_simulation_holds(p: int, v: int, m: int) -> None:
    profile = make_profile(
        [(10 + i, 20 + 2 * i, 1000 * (i + 1), 10) for i in range(p * v)],
        [(i, i + 1) for i in range(p * v - 1)],
    )
    cuts = [f"l{i}" for i in range(p * v - 1)]
    plan = evaluate(profile, Cluster.flat(p), cuts, [1] * (p * v), "interleaved", m, virtual_stages=v)
    sim = simulate(plan, profile)
    assert sim.in_flight == tuple(in_flight("interleaved", k, [1] * (p * v), m, v) for k in range(p * v))
    assert tuple(s.memory_bytes for s in plan.stages) == sim.peak_memory_bytes


def test_one_chunk_per_rank_prices_as_1f1b_in_flight() -> None:
    assert [in_flight("interleaved", k, [1] * 4, 6) for k in range(4)] == [
        in_flight("1f1b", k, [1] * 4, 6) for k in range(4)
    ]


def test_solve_plans_virtual_stages_faster_than_1f1b_on_equal_layers() -> None:
    profile, _ = _even(8)
    plan = solve(profile, Cluster.flat(2), "interleaved", 4, virtual_stages=2)
    one = solve(profile, Cluster.flat(2), "1f1b", 4, straight=True)
    assert plan.schedule == "interleaved" and plan.virtual_stages == 2
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (0,), (1,)]
    assert sorted(n for s in plan.stages for n in s.nodes) == sorted(n for s in one.stages for n in s.nodes)
    assert plan.predicted.time_per_minibatch_s < one.predicted.time_per_minibatch_s
    assert plan_from_json(plan_to_json(plan)).virtual_stages == 2


def test_bad_interleaved_requests_are_refused() -> None:
    profile, cuts = _even(4)
    with pytest.raises(PlanError, match="multiple of the 2 ranks"):
        solve(profile, Cluster.flat(2), "interleaved", 3, virtual_stages=2)
    with pytest.raises(PlanError, match="at least 2 GPUs"):
        solve(profile, Cluster.flat(1), "interleaved", 4, virtual_stages=2)
    with pytest.raises(PlanError, match="needs 8 stages"):
        solve(profile, Cluster.flat(4), "interleaved", 4, virtual_stages=2)
    with pytest.raises(PlanError, match="one device each"):
        evaluate(profile, Cluster.flat(3), cuts[:1], [2, 1], "interleaved", 4, virtual_stages=2)


def test_a_device_holds_all_its_chunks_against_the_memory_limit() -> None:
    from partitioner.errors import InfeasibleError

    profile = make_profile([(10, 20, 4000, 10_000)] * 8, [(i, i + 1) for i in range(7)])
    plan = solve(profile, Cluster.flat(2), "interleaved", 4, virtual_stages=2)
    per_device = [sum(s.memory_bytes for s in plan.stages if s.ranks == (r,)) for r in range(2)]
    assert max(per_device) > max(s.memory_bytes for s in plan.stages)
    solve(profile, Cluster.flat(2, memory_bytes=max(per_device)), "interleaved", 4, virtual_stages=2)
    with pytest.raises(InfeasibleError, match="fewer --virtual-stages"):
        solve(profile, Cluster.flat(2, memory_bytes=max(per_device) - 1), "interleaved", 4, virtual_stages=2)


def _random_chain(rng: random.Random, layers: int) -> Profile:
    costs = [
        (rng.randint(2, 20), rng.randint(2, 40), rng.choice([0, 2000, 8000, 30000]), 10)
        for _ in range(layers)
    ]
    return make_profile(costs, [(i, i + 1) for i in range(layers - 1)])


def test_few_splits_are_all_priced_so_the_plan_is_the_best_contiguous_split() -> None:
    rng = random.Random(1)
    for _ in range(15):
        n, cluster = rng.randint(5, 8), Cluster.flat(2, bandwidth=1e7)
        profile = _random_chain(rng, n)
        plan = solve(profile, cluster, "interleaved", 4, virtual_stages=2)
        best = min(
            evaluate(
                profile, cluster, [f"l{c}" for c in cuts], [1] * 4, "interleaved", 4, virtual_stages=2
            ).predicted.time_per_minibatch_s
            for cuts in itertools.combinations(range(n - 1), 3)
        )
        assert plan.predicted.time_per_minibatch_s == pytest.approx(best, rel=1e-12)


def test_a_plan_predicts_what_the_simulation_plays() -> None:
    """The closed form only ranks the candidates: a plan's time and bubble are the event simulation's
    of the runtime's lists, for solve and evaluate alike, on unequal stages (where the closed form
    is only a lower bound: test above)."""
    rng = random.Random(4)
    for _ in range(10):
        profile, cluster = _random_chain(rng, 7), Cluster.flat(2, bandwidth=1e7)
        for plan in (
            solve(profile, cluster, "interleaved", 4, virtual_stages=2),
            evaluate(profile, cluster, ["l0", "l2", "l4"], [1] * 4, "interleaved", 4, virtual_stages=2),
        ):
            sim = simulate(plan, profile)
            assert plan.predicted.time_per_minibatch_s == pytest.approx(sim.time_per_minibatch_s, rel=1e-12)
            assert plan.predicted.bubble_fraction == pytest.approx(sim.bubble_fraction, rel=1e-12)
            assert plan.extra["priced_by"] == "simulation"


def test_many_splits_climb_from_the_time_balanced_one() -> None:
    """24 layers in 8 stages: 245,157 contiguous splits, too many to price; the climb never ends
    above the time-balanced split it starts from."""
    from partitioner.optimizer.search.candidates import balanced_cuts

    rng = random.Random(2)
    for _ in range(3):
        profile, cluster = _random_chain(rng, 24), Cluster.flat(2, bandwidth=1e7)
        plan = solve(profile, cluster, "interleaved", 4, virtual_stages=4)
        bounds = balanced_cuts([n.compute_ms for n in profile.layers], 8)
        cuts = [f"l{b - 1}" for b in bounds[1:-1]]
        start = evaluate(profile, cluster, cuts, [1] * 8, "interleaved", 4, virtual_stages=4)
        assert plan.predicted.time_per_minibatch_s <= start.predicted.time_per_minibatch_s
        assert len(plan.stages) == 8 and plan.virtual_stages == 4
