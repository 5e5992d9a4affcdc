"""A device of several stages: its peak walked from its rank's own list."""

from __future__ import annotations

import pytest

from partitioner.optimizer import evaluate
from partitioner.optimizer.pricing.device_memory import StageBytes, walked_peak
from partitioner.optimizer.pricing.price import stage_loads, stage_memory, stage_transient
from partitioner.optimizer.pricing.simulate import simulate
from partitioner.plan import Cluster
from runtime.schedule import Action
from tests.partitioner.optimizer.conftest import make_profile

A, B = StageBytes(kept=10, grads=10, item=5, transient=3), StageBytes(kept=20, grads=20, item=1, transient=7)


def _list(text: str) -> list[Action]:
    """``F0.0 B1.0 S0``: kind, stage, item (a step's index 0)."""
    out = []
    for word in text.split():
        stage, _, index = word[1:].partition(".")
        out.append(Action(int(stage), word[0], int(index or 0)))
    return out


def test_gradients_appear_with_a_stage_s_first_backward_and_one_transient_runs_at_a_time() -> None:
    """Stage 1's backwards run while stage 0 holds both its items but no gradients yet (61 + 7); the
    peak is stage 0's first backward (all gradients, stage 0's two items, its transient: 73), below
    the stages' summed closed forms less the smaller transient (33 + 48 - 3 = 78)."""
    actions = _list("F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 B0.0 B0.1 S0 S1")
    assert walked_peak(actions, {0: A, 1: B}, split=False) == 73
    assert walked_peak(_list("F0.0 F0.1 B0.0 B0.1 S0"), {0: A}, split=False) == 10 + 10 + 2 * 5 + 3


def test_a_split_backward_keeps_the_item_until_its_w() -> None:
    """B makes no weight gradient and frees nothing; W does both."""
    actions = _list("F0.0 F0.1 B0.0 B0.1 W0.0 W0.1 S0")
    assert walked_peak(actions, {0: A}, split=True) == 10 + 10 + 2 * 5 + 3  # W0.0: both items, gradients
    assert walked_peak(_list("F0.0 B0.0 F0.1 W0.0 B0.1 W0.1 S0"), {0: A}, split=True) == 10 + 10 + 5 + 5 + 3


def test_between_its_b_and_its_w_an_item_keeps_what_w_needs() -> None:
    """B keeps the gradients W needs (``deferred``, 2 an item here) until that item's W drops them."""
    a = StageBytes(kept=10, grads=10, item=5, transient=3, deferred=2)
    actions = _list("F0.0 F0.1 B0.0 B0.1 W0.0 W0.1 S0")
    assert walked_peak(actions, {0: a}, split=True) == 10 + 10 + 2 * 5 + 2 * 2 + 3
    assert (
        walked_peak(_list("F0.0 B0.0 F0.1 W0.0 B0.1 W0.1 S0"), {0: a}, split=True) == 10 + 10 + 5 + 5 + 2 + 3
    )


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_a_plan_prices_a_device_by_its_walk_and_the_simulation_agrees(schedule: str) -> None:
    """A device's stages add up to at most their summed closed forms less all but the largest
    transient (less than that on one device at least), and the simulation gives the same per
    stage."""
    profile = make_profile(
        [(10, 20, 1000 * (i + 1), 4000 * (i + 1)) for i in range(4)], [(i, i + 1) for i in range(3)]
    )
    virtual = {"virtual_stages": 2} if schedule == "interleaved" else {}
    plan = evaluate(profile, Cluster.flat(2), ["l0", "l1", "l2"], [1] * 4, schedule, 4, **virtual)  # type: ignore[arg-type]
    loads = stage_loads(profile, [s.nodes for s in plan.stages])
    reps, v = [1] * 4, plan.virtual_stages
    alone = [stage_memory(ld, schedule, i, reps, 4, plan.optimizer, False, v) for i, ld in enumerate(loads)]
    transient = [
        stage_transient(ld, schedule, i, reps, 4, plan.optimizer, False, v) for i, ld in enumerate(loads)
    ]
    below = []
    for rank in (0, 1):
        hosted = [s.index for s in plan.stages if rank in s.ranks]
        device = sum(plan.stages[k].memory_bytes for k in hosted)
        bound = sum(alone[k] for k in hosted) - min(transient[k] for k in hosted)
        assert 0 < device <= bound + 1
        below.append(device < bound - 1)
    assert any(below)  # a stage's gradients do not exist yet while another's backward runs
    assert simulate(plan, profile).peak_memory_bytes == tuple(s.memory_bytes for s in plan.stages)
