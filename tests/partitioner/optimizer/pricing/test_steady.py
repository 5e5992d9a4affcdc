"""A flushing plan's time is its steady period: the runtime has no barrier at the step, so a rank
starts the next minibatch once it has stepped and the next fill overlaps the last drain
(``simulate.STEADY_MINIBATCHES``)."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest

from partitioner.graph import Profile
from partitioner.optimizer import evaluate
from partitioner.optimizer.pricing import simulate as simulation
from partitioner.optimizer.pricing.simulate import simulate, stage_bubbles
from partitioner.plan import Cluster, Link, Plan
from tests.partitioner.optimizer.conftest import make_profile

SCHEDULES = ("1f1b", "gpipe", "zb1p", "interleaved", "zbv")


def _random_plan(rng: random.Random, schedule: str) -> tuple[Plan, Profile]:
    """2 to 4 ranks of unequal one-layer stages, links with a latency, a replica where the schedule
    allows one."""
    ranks = rng.randint(2, 4)
    virtual = 2 if schedule in ("interleaved", "zbv") else 1
    stages = ranks * virtual
    costs = [
        (rng.randint(5, 40), rng.randint(8, 80), rng.choice([0, 10**5, 10**6]), 10**6) for _ in range(stages)
    ]
    profile = make_profile(costs, [(i, i + 1) for i in range(stages - 1)])
    replicas = [1] * stages
    if virtual == 1 and rng.random() < 0.3:
        replicas[rng.randrange(stages)] = 2
    fixed = {"interleaved": ranks * rng.randint(1, 2), "zbv": 2 * ranks + rng.randint(0, 1)}
    microbatches = fixed.get(schedule, rng.choice([1, 2, 3, 4, 8]) * max(replicas))
    cluster = Cluster.flat(sum(replicas) // virtual, Link(1e9, rng.choice([0.0, 1e-4, 1e-3])))
    cuts = [f"l{i}" for i in range(stages - 1)]
    v = virtual if schedule == "interleaved" else 1  # (zbv's two stages per rank are its own)
    plan = evaluate(profile, cluster, cuts, replicas, schedule, microbatches, virtual_stages=v)
    return plan, profile


def test_the_period_is_steady_by_the_minibatches_played(monkeypatch: pytest.MonkeyPatch) -> None:
    """On 300 random plans the period taken from 4 minibatches is the one from 16: the played
    lists have reached their steady state."""
    rng = random.Random(5)
    plans = [_random_plan(rng, rng.choice(SCHEDULES)) for _ in range(300)]
    four = [simulate(plan, profile).time_per_minibatch_s for plan, profile in plans]
    monkeypatch.setattr(simulation, "STEADY_MINIBATCHES", 16)
    sixteen = [simulate(plan, profile).time_per_minibatch_s for plan, profile in plans]
    assert four == pytest.approx(sixteen, rel=1e-9)


def test_the_next_minibatch_fills_the_last_one_s_drain() -> None:
    """Per schedule, 120 random plans: the period never exceeds one minibatch's span, and where
    the rank that ends a minibatch is not the one that starts the next, it is shorter. Prints the
    figures docs/optimizer-pricing.md quotes (``pytest -s``)."""
    rng = random.Random(7)
    for schedule in SCHEDULES:
        ratios = []
        for _ in range(120):
            plan, profile = _random_plan(rng, schedule)
            sim = simulate(plan, profile)
            ratios.append(sim.time_per_minibatch_s / max(e.end_s for e in sim.events))
        print(f"{schedule}: period / span min {min(ratios):.2f}, median {statistics.median(ratios):.2f}")
        assert max(ratios) <= 1 + 1e-9
        if schedule in ("zb1p", "zbv"):
            assert min(ratios) < 0.97


def test_zb1p_s_heavier_last_stage_computes_without_a_break() -> None:
    """Two stages, M = 2, F = B = W = 1 ms a microbatch on stage 0 and 2 ms on stage 1, no links.
    Minibatch 0: stage 1 runs F0 [1, 3], B0, F1, B1, W0, W1 to 13; stage 0 ends its W1 at 11 and
    runs the next minibatch's F2 [11, 12] and F3 [12, 13], so stage 1 goes on at 13 without a
    break: a minibatch every 12 ms (its own 6 actions of 2 ms), against a span of 13; stage 0
    computes 6 ms of them (bubble 0.5), stage 1 all 12 (bubble 0)."""
    profile = make_profile([(2, 4, 0, 10), (4, 8, 0, 10)], [(0, 1)])
    plan = evaluate(profile, Cluster.flat(2), ["l0"], [1, 1], "zb1p", 2)
    sim = simulate(plan, profile)
    assert max(e.end_s for e in sim.events) == pytest.approx(0.013)
    assert sim.time_per_minibatch_s == pytest.approx(0.012)
    assert plan.predicted.time_per_minibatch_s == pytest.approx(0.012)
    assert stage_bubbles(plan, sim) == pytest.approx((0.5, 0.0))
    fp16 = simulate(replace(plan, precision="fp16"), profile)  # every rank meets at the step
    assert fp16.time_per_minibatch_s == pytest.approx(0.013)
