"""Activation recomputation in the cost model, the solvers, ``auto`` and the simulation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile
from partitioner.optimizer import evaluate, solve
from partitioner.optimizer.pricing.price import price_stage, stage_loads
from partitioner.optimizer.pricing.recompute import recomputing
from partitioner.optimizer.pricing.simulate import simulate
from partitioner.plan import Cluster, Plan
from tests.partitioner.optimizer.conftest import make_profile

# forward 10, 5, 15 ms; outputs (= saved) 4 MB, 1 MB, 0; params 1 MB, 0, 2 MB; the input x is 1000 B
THREE = make_profile([(10, 20, 4_000_000, 1_000_000), (5, 10, 1_000_000, 0), (15, 30, 0, 2_000_000)],
                     [(0, 1), (1, 2)])  # fmt: skip


def _heavy() -> Profile:
    """l0 keeps 20 MB for backward but passes on 1000 B; l1 keeps 1 MB: recomputing l0 pays."""
    profile = make_profile([(10, 20, 1000, 0), (10, 20, 1_000_000, 0)], [(0, 1)])
    nodes = tuple(replace(n, saved_bytes=20_000_000) if n.id == "l0" else n for n in profile.nodes)
    return replace(profile, nodes=nodes)


def test_price_stage_by_hand() -> None:
    s0, s1 = stage_loads(THREE, [("x", "l0"), ("l1", "l2")])
    assert (s0.forward_s, s0.input_bytes, s1.forward_s, s1.input_bytes) == (0.010, 1000, 0.020, 4_000_000)
    # 1f1b, M=4, replicas (2, 1). Stage 0 holds min(2, 4) = 2 microbatches, one on each replica, a
    # whole microbatch (1/4 of a minibatch) each: kept 2P + P (a replica runs 2 of the 4 microbatches:
    # l0's gradient beside the sum) + 4e6/4 = 4e6; recomputing, 3P + (1 input of 1000 + the rebuilt
    # item's 4e6) / 4, and +10 ms
    kept = price_stage(s0, "1f1b", 0, (2, 1), 4, "sgd", recompute=False)
    redo = price_stage(s0, "1f1b", 0, (2, 1), 4, "sgd", recompute=True)
    assert (kept.compute_s, kept.memory_bytes) == (pytest.approx(0.030), 4_000_000)
    assert (redo.compute_s, redo.memory_bytes) == (pytest.approx(0.040), 3_000_000 + 1_000_250)
    # stage 1 holds 1 microbatch of 1/4: recomputing keeps its 4 MB input, more than its 1 MB saved;
    # it accumulates l2's 2 MB gradient
    redo1 = price_stage(s1, "1f1b", 1, (2, 1), 4, "sgd", recompute=True)
    assert redo1.compute_s == pytest.approx(0.080)
    assert redo1.memory_bytes == 4_000_000 + 2_000_000 + 5_000_000 // 4
    # pipedream: stage 0 holds ceil(3/2) = 2 minibatches and a weight snapshot for each
    pd = price_stage(s0, "pipedream", 0, (2, 1), 1, "sgd", recompute=True)
    assert pd.memory_bytes == 2_000_000 + 2 * 1_000_000 + 2 * 1000 + 4_000_000


def test_a_stage_holds_its_copy_of_a_kept_input_once_an_item() -> None:
    """l0 keeps its 4 MB output (``kept_output_bytes``, counted in its saved bytes on stage 0): stage
    1 holds its own copy per item, beside its 1 MB saved; recomputing, the copy is the input it
    keeps anyway (4 MB + the rebuilt 1 MB, as in :func:`test_price_stage_by_hand`), not charged twice."""
    nodes = tuple(replace(n, kept_output_bytes=4_000_000) if n.id == "l0" else n for n in THREE.nodes)
    _, s1 = stage_loads(replace(THREE, nodes=nodes), [("x", "l0"), ("l1", "l2")])
    assert (s1.received_bytes, s1.item_bytes) == (4_000_000, 5_000_000)
    kept = price_stage(s1, "1f1b", 1, (2, 1), 4, "sgd", recompute=False)
    redo = price_stage(s1, "1f1b", 1, (2, 1), 4, "sgd", recompute=True)
    assert kept.memory_bytes == 4_000_000 + 2_000_000 + 5_000_000 // 4
    assert redo.memory_bytes == 4_000_000 + 2_000_000 + 5_000_000 // 4


def test_plan_of_recomputing_stages_by_hand() -> None:
    plan = evaluate(THREE, Cluster.flat(3), ["l0"], [2, 1], "1f1b", 4, recompute="all")
    assert [s.recompute for s in plan.stages] == [True, True]
    assert [s.compute_s for s in plan.stages] == [pytest.approx(0.040), pytest.approx(0.080)]
    assert [s.memory_bytes for s in plan.stages] == [4_000_250, 7_250_000]  # (with the accumulated gradient)
    # per microbatch: 0.040/8 + cut 2*4e6/(1e9*2)/4 = 0.006 and 0.080/4 = 0.020; + 3 * 0.020 + 0.002
    assert plan.predicted.time_per_minibatch_s == pytest.approx(0.088)
    assert plan.extra["recompute"] == "all"


def test_auto_recomputes_exactly_the_stages_over_the_limit() -> None:
    # pipedream [2, 1]: stage 0 kept 12e6, recomputing 8.002e6; stage 1 kept 5e6, recomputing 9e6
    def flags(limit: int | None) -> list[bool]:
        plan = evaluate(THREE, Cluster.flat(3, memory_bytes=limit), ["l0"], [2, 1], recompute="auto")
        return [s.recompute for s in plan.stages]

    assert flags(None) == [False, False]
    assert flags(12_000_000) == [False, False]
    assert flags(11_999_999) == [True, False]
    with pytest.raises(InfeasibleError):
        flags(8_001_999)


@pytest.mark.parametrize("schedule", ["gpipe", "pipedream"])
def test_auto_solve_recomputes_only_when_nothing_fits_otherwise(schedule: str) -> None:
    profile = _heavy()
    for roomy in (Cluster.flat(2, memory_bytes=10**9), Cluster.flat(2)):
        plan = solve(profile, roomy, schedule, 4, recompute="auto")
        assert not any(s.recompute for s in plan.stages) and plan.extra["recompute"] == "auto"
    kept = max(s.memory_bytes for s in solve(profile, Cluster.flat(2), schedule, 4).stages)
    # 0.6 of it: no plan fits without recomputing; gpipe's 2 replicas recomputing hold 2 microbatches'
    # inputs and one rebuilt microbatch of 1/4 (half of what they keep) and a little more
    limit = kept * 6 // 10
    tight = Cluster.flat(2, memory_bytes=limit)
    with pytest.raises(InfeasibleError):
        solve(profile, tight, schedule, 4, recompute="none")
    if schedule == "pipedream":  # one minibatch per replica here: recomputing cannot save anything
        with pytest.raises(InfeasibleError, match="even with every stage recomputing"):
            solve(profile, tight, schedule, 4, recompute="auto")
        return
    plan = solve(profile, tight, schedule, 4, recompute="auto")
    assert any(s.recompute for s in plan.stages) and all(s.memory_bytes <= limit for s in plan.stages)
    without = evaluate(profile, Cluster.flat(2), _cuts(plan), [s.replicas for s in plan.stages], schedule, 4)
    for stage, alone in zip(plan.stages, without.stages, strict=True):  # exactly those over the limit
        assert stage.recompute == (alone.memory_bytes > limit)


def test_all_prices_the_searched_plan_exactly() -> None:
    plan = solve(THREE, Cluster.flat(3), "1f1b", 4, recompute="all")
    assert all(s.recompute for s in plan.stages)
    again = evaluate(THREE, Cluster.flat(3), _cuts(plan), [s.replicas for s in plan.stages], "1f1b",
                     plan.microbatches, recompute="all")  # fmt: skip
    assert [s.memory_bytes for s in plan.stages] == [s.memory_bytes for s in again.stages]
    assert plan.predicted.time_per_minibatch_s == pytest.approx(again.predicted.time_per_minibatch_s)


def test_recomputing_profile_pays_the_forward_twice_and_saves_nothing() -> None:
    twice = recomputing(THREE)
    for old, new in zip(THREE.nodes, twice.nodes, strict=True):
        assert new.compute_ms == old.compute_ms + old.forward_ms and new.saved_bytes == 0


def test_unknown_mode() -> None:
    with pytest.raises(PlanError, match="recompute"):
        solve(THREE, Cluster.flat(2), recompute="some")
    with pytest.raises(PlanError, match="recompute"):
        evaluate(THREE, Cluster.flat(2), ["l0"], [1, 1], recompute="some")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "pipedream"])
@pytest.mark.parametrize("mode", ["none", "all"])
def test_simulation_holds_what_the_cost_model_prices(schedule: str, mode: str) -> None:
    cuts, replicas = ["l0", "l1"], [1, 1, 1]
    plan = evaluate(THREE, Cluster.flat(3), cuts, replicas, schedule, 4, recompute=mode)
    sim = simulate(plan, THREE)
    assert sim.peak_memory_bytes == tuple(s.memory_bytes for s in plan.stages)
    if schedule != "pipedream":  # the forward twice in every backward of the timeline too
        assert sim.time_per_minibatch_s == pytest.approx(plan.predicted.time_per_minibatch_s)
        forwards = [e.end_s - e.start_s for e in sim.events if e.kind == "F" and e.stage == 0]
        backwards = [e.end_s - e.start_s for e in sim.events if e.kind == "B" and e.stage == 0]
        assert backwards[0] == pytest.approx(forwards[0] * (3 if mode == "all" else 2))


def _cuts(plan: Plan) -> list[str]:
    return [[n for n in s.nodes if n != "x"][-1] for s in plan.stages[:-1]]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
def test_a_recomputing_last_stage_keeps_the_loss_of_every_item_in_flight(schedule: str) -> None:
    """The runtime runs the loss outside the recomputed forward (``runtime.executing.stage``), so a
    recomputing last stage keeps the loss's saved bytes (the output node's) for every item in flight, beside
    its inputs; the plan, the simulation and the search on the recomputing profile agree."""
    loss = 8_000_000
    # (no weights on the last stage: no gradient added in a later backward, whose peak holds fewer items)
    light = replace(THREE, nodes=tuple(replace(n, param_bytes=0) if n.id == "l2" else n for n in THREE.nodes))
    nodes = tuple(replace(n, op="output") if n.id == "l2" else n for n in light.nodes)
    profile = replace(light, nodes=tuple(replace(n, saved_bytes=loss) if n.id == "l2" else n for n in nodes))
    m = 1 if schedule == "pipedream" else 4
    without = evaluate(light, Cluster.flat(3), ["l0", "l1"], [1, 1, 1], schedule, m, recompute="all")
    plan = evaluate(profile, Cluster.flat(3), ["l0", "l1"], [1, 1, 1], schedule, m, recompute="all")
    held = simulate(plan, profile).in_flight[-1]  # gpipe: all 4; 1f1b and pipedream: 1
    assert held == (4 if schedule == "gpipe" else 1)
    assert plan.stages[-1].memory_bytes - without.stages[-1].memory_bytes == held * loss // m
    assert simulate(plan, profile).peak_memory_bytes == tuple(s.memory_bytes for s in plan.stages)
    assert [n.saved_bytes for n in recomputing(profile).nodes if n.op == "output"] == [loss]
