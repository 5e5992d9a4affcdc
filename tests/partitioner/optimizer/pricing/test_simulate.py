"""The event simulation against the closed forms, and its outputs (trace, Gantt)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from partitioner.optimizer import evaluate
from partitioner.optimizer.pricing.price import stage_loads
from partitioner.optimizer.pricing.schedules import in_flight
from partitioner.optimizer.pricing.simulate import (
    gantt,
    simulate,
    stage_bubbles,
    with_stage_bubbles,
    write_chrome_trace,
)
from partitioner.plan import Cluster, plan_from_json, plan_to_json
from tests.partitioner.optimizer.conftest import make_profile

EVEN = make_profile([(10, 20, 0, 0)] * 4, [(0, 1), (1, 2), (2, 3)])


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_synchronous_closed_form_matches_simulation(schedule: str, m: int) -> None:
    plan = evaluate(EVEN, Cluster.flat(4), ["l0", "l1", "l2"], [1, 1, 1, 1], schedule, m)
    sim = simulate(plan, EVEN)
    # equal stages, no communication: (M + p - 1) slots of one microbatch's forward+backward
    assert sim.time_per_minibatch_s == pytest.approx(plan.predicted.time_per_minibatch_s)
    assert sim.time_per_minibatch_s == pytest.approx((m + 3) * 0.030 / m)
    assert sim.bubble_fraction == pytest.approx(3 / (m + 3))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb1p"])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_fixed_times_per_call_are_priced_alike_by_the_plan_and_the_simulation(schedule: str, m: int) -> None:
    fixed = replace(
        EVEN, nodes=tuple(replace(n, forward_fixed_ms=1.0, backward_fixed_ms=2.0) for n in EVEN.nodes)
    )
    plan = evaluate(fixed, Cluster.flat(4), ["l0", "l1", "l2"], [1, 1, 1, 1], schedule, m)
    assert simulate(plan, fixed).time_per_minibatch_s == pytest.approx(plan.predicted.time_per_minibatch_s)
    # each of the m microbatches pays every layer's 3 ms once; the profile's times hold one call
    assert plan.stages[0].compute_s == pytest.approx(0.030 + (m - 1) * 0.003)
    if schedule != "zb1p":
        assert plan.predicted.time_per_minibatch_s == pytest.approx((m + 3) * (0.030 + (m - 1) * 0.003) / m)


def test_pipedream_steady_state_is_the_slowest_stage() -> None:
    profile = make_profile([(10, 20, 0, 0), (20, 40, 0, 0), (5, 10, 0, 0)], [(0, 1), (1, 2)])
    plan = evaluate(profile, Cluster.flat(3), ["l0", "l1"], [1, 1, 1])
    sim = simulate(plan, profile, minibatches=20)
    assert sim.time_per_minibatch_s == pytest.approx(0.060)
    assert sim.time_per_minibatch_s == pytest.approx(plan.predicted.time_per_minibatch_s)


def test_in_flight_per_schedule() -> None:
    for schedule, expect in (("1f1b", (4, 3, 2, 1)), ("gpipe", (8, 8, 8, 8))):
        plan = evaluate(EVEN, Cluster.flat(4), ["l0", "l1", "l2"], [1, 1, 1, 1], schedule, 8)
        assert simulate(plan, EVEN).in_flight == expect


def test_trace_and_gantt(tmp_path: Path) -> None:
    plan = evaluate(EVEN, Cluster.flat(4), ["l0", "l1", "l2"], [1, 1, 1, 1], "1f1b", 4)
    sim = simulate(plan, EVEN)
    doc = json.loads(write_chrome_trace(sim, tmp_path / "t.json").read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 4 * 2 * 4 + 4  # forwards, backwards, and one sync+step per stage
    rows = gantt(sim, width=40)
    assert len(rows) == 4 and all(len(r) == len(rows[0]) for r in rows)


@pytest.mark.parametrize("replicas", [(3, 1), (2, 1, 1), (15, 1)])
def test_replicated_pipedream_holds_and_takes_what_the_cost_model_prices(replicas: tuple[int, ...]) -> None:
    """Rank by rank from the runtime's lists: each replica holds cost.in_flight minibatches (the
    memory model's), and the steady state is the cost model's slowest (C + all-reduce) / r."""
    p = len(replicas)
    profile = make_profile([(10 * r, 20 * r, 0, 1000) for r in replicas], [(i, i + 1) for i in range(p - 1)])
    cluster = Cluster.flat(sum(replicas), bandwidth=1e6)
    plan = evaluate(profile, cluster, [f"l{i}" for i in range(p - 1)], list(replicas))
    sim = simulate(plan, profile)
    assert sim.in_flight == tuple(in_flight("pipedream", k, replicas, 1) for k in range(p))
    assert sim.peak_memory_bytes == tuple(s.memory_bytes for s in plan.stages)
    if replicas == (2, 1, 1):
        # The replicas step in lock-step while stage 1 feeds them one after the other: PipeDream's
        # closed form (a throughput bound) is 31 ms, its schedule takes 46 ms here. A known gap.
        assert sim.time_per_minibatch_s == pytest.approx(0.046, rel=0.02)
    else:
        assert sim.time_per_minibatch_s == pytest.approx(plan.predicted.time_per_minibatch_s, rel=0.02)


def test_an_output_read_two_stages_on_crosses_both_cuts() -> None:
    # l0 (4000 B) is read by l1 and l2; l1 (2000 B) by l2: cut 0 carries l0, cut 1 carries l0 and l1
    profile = make_profile([(1, 2, 4000, 0), (1, 2, 2000, 0), (1, 2, 0, 0)], [(0, 1), (0, 2), (1, 2)])
    plan = evaluate(profile, Cluster.flat(3), ["l0", "l1"], [1, 1, 1])
    assert [ld.out_bytes for ld in stage_loads(profile, [s.nodes for s in plan.stages])] == [
        4000.0,
        6000.0,
        0.0,
    ]


@pytest.mark.parametrize("m", [1, 2, 8])
def test_each_stage_of_an_even_pipeline_idles_its_share_of_fill_and_drain(m: int) -> None:
    plan = evaluate(EVEN, Cluster.flat(4), ["l0", "l1", "l2"], [1, 1, 1, 1], "1f1b", m)
    assert stage_bubbles(plan, simulate(plan, EVEN)) == pytest.approx([3 / (m + 3)] * 4)


UNEVEN = make_profile([(10, 20, 0, 1e6), (30, 50, 0, 2e6), (5, 10, 0, 1e6), (20, 20, 0, 1e5)],
                      [(0, 1), (1, 2), (2, 3)])  # fmt: skip


@pytest.mark.parametrize(
    ("schedule", "virtual"),
    [("1f1b", 1), ("gpipe", 1), ("zb1p", 1), ("pipedream", 1), ("interleaved", 2), ("zbv", 2)],
)
def test_stage_bubbles_average_to_the_simulation_s_bubble(schedule: str, virtual: int) -> None:
    """The per-stage figures plan.json keeps are the simulation's bubble split by device: their mean
    over the devices is the plan's; a rank hosting several stages gives each the rank's figure."""
    cuts = ["l0", "l1", "l2"] if virtual > 1 else ["l0", "l2"]
    gpus = 2 if virtual > 1 else 3
    v = virtual if schedule == "interleaved" else 1  # (zbv's two stages per rank are its own)
    plan = evaluate(UNEVEN, Cluster.flat(gpus), cuts, [1] * (len(cuts) + 1), schedule, 4, virtual_stages=v)
    sim = simulate(plan, UNEVEN, minibatches=12 if schedule == "pipedream" else None)
    bubbles = stage_bubbles(plan, sim)
    assert sum(bubbles) / len(bubbles) == pytest.approx(sim.bubble_fraction)
    # (zb1p's slowest stage, 80 ms an item, computes without a break in the steady state: the others'
    # deferred Ws let the next minibatch's forwards reach it before it runs out of work)
    assert min(bubbles) >= 0 and max(bubbles) < 1 and len(set(bubbles)) > 1
    for a in plan.stages:  # the stages of one rank share its figure
        for b in plan.stages:
            if a.ranks == b.ranks:
                assert bubbles[a.index] == bubbles[b.index]


def test_stage_bubbles_travel_in_plan_json_and_old_plans_have_none() -> None:
    plan = evaluate(UNEVEN, Cluster.flat(3), ["l0", "l2"], [1, 1, 1], "1f1b", 4)
    sim = simulate(plan, UNEVEN)
    doc = plan_to_json(with_stage_bubbles(plan, sim))
    assert [s["bubble_fraction"] for s in doc["stages"]] == list(stage_bubbles(plan, sim))
    assert plan_from_json(doc).stages == with_stage_bubbles(plan, sim).stages
    old = plan_to_json(plan)  # a plan not simulated (or written before) says nothing of it
    assert all("bubble_fraction" not in s for s in old["stages"])
    assert all(s.bubble_fraction is None for s in plan_from_json(old).stages)
