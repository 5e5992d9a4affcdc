"""The synchronous schedules' branch and bound against brute force on random small DAGs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from partitioner.optimizer import solve
from partitioner.plan import Cluster, Link
from tests.partitioner.optimizer.conftest import make_profile, searched_s
from tests.partitioner.optimizer.search.test_dp import ACTIONS, LATENCIES, SYNCS, brute_force, dags


@settings(max_examples=60, deadline=None)
@given(dag=dags, gpus=st.integers(1, 4), schedule=st.sampled_from(["1f1b", "gpipe"]),
       microbatches=st.sampled_from([1, 2, 4, 8]), straight=st.booleans(), comm=st.booleans(),
       latency=LATENCIES, sync=SYNCS, action=ACTIONS)  # fmt: skip
def test_synchronous_plans_are_optimal(
    dag: tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]],
    gpus: int,
    schedule: str,
    microbatches: int,
    straight: bool,
    comm: bool,
    latency: float,
    sync: tuple[float | None, float | None],
    action: float,
) -> None:
    """1f1b and gpipe: sum + (M-1) slowest + all-reduce, minimised exactly, and proven so (the
    plan is then priced by the simulation: ``searched_s`` is the closed form the search saw), with
    or without the runtime's time per action (2M a stage)."""
    costs, raw = dag
    profile = make_profile(costs, [(a, b) for a, b in raw if a < b])
    cluster = replace(Cluster.flat(gpus, Link(1e5, latency, *sync)), action_s=action)
    plan = solve(profile, cluster, schedule, microbatches, straight=straight, activation_comm=comm)
    # optimal at the microbatch count it uses (raised towards one every replica count divides, if needed)
    expected = brute_force(profile, cluster, straight, comm, schedule, plan.microbatches)
    assert searched_s(plan) == pytest.approx(expected, rel=1e-9)
    assert plan.solver.optimal
    assert plan.solver.lower_bound_s == pytest.approx(expected, rel=1e-9)
    if straight:
        assert all(s.replicas == 1 for s in plan.stages)


def test_synchronous_trades_the_slowest_stage_against_the_sum() -> None:
    """A plan with an uneven stage can beat the bottleneck-optimal one when M is small.

    Four equal layers (10 ms each) on 2 devices, one microbatch: two stages run one after the
    other (40 ms, no overlap), one stage on both devices takes half (its all-reduce is free here).
    """
    profile = make_profile([(5, 5, 0, 0)] * 4, [(i, i + 1) for i in range(3)])
    plan = solve(profile, Cluster.flat(2, 1e12), "gpipe", 1)
    assert [s.replicas for s in plan.stages] == [2]  # data parallel: 20 ms instead of 40
    assert plan.predicted.time_per_minibatch_s == pytest.approx(0.020)
    assert plan.solver.optimal


@settings(max_examples=40, deadline=None, phases=(Phase.explicit, Phase.generate))  # no shrinking: minutes
@given(dag=dags, gpus=st.integers(1, 4), microbatches=st.sampled_from([1, 2, 4]),
       limit=st.integers(8_000, 40_000))  # fmt: skip
def test_gpipe_under_a_memory_limit_is_optimal(
    dag: tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]],
    gpus: int,
    microbatches: int,
    limit: int,
) -> None:
    """gpipe holds all M microbatches on every stage: the search's memory filter is its exact model,
    so the plan is the best that fits (or nothing fits, for both; where brute force still fits one,
    the known defect of the next test, the run is marked xfail with the figure)."""
    from partitioner.errors import InfeasibleError

    costs, raw = dag
    profile = make_profile(costs, [(a, b) for a, b in raw if a < b])
    cluster = Cluster.flat(gpus, 1e5, limit)
    try:
        plan = solve(profile, cluster, "gpipe", microbatches, "adam")
    except InfeasibleError:
        asked = brute_force(profile, cluster, schedule="gpipe", microbatches=microbatches, optimizer="adam")
        if asked < math.inf:  # the known defect of the next test: marked, not hidden
            pytest.xfail(f"the search found nothing where brute force fits {asked * 1e3:.2f} ms")
        return
    # compared at the microbatch count the plan uses (raised where its replicas need it)
    m = plan.microbatches
    expected = brute_force(profile, cluster, schedule="gpipe", microbatches=m, optimizer="adam")
    assert searched_s(plan) == pytest.approx(expected, rel=1e-9)
    assert max(s.memory_bytes for s in plan.stages) <= limit


@pytest.mark.xfail(strict=True, reason="known defect: the search misses a plan brute force finds")
def test_gpipe_under_a_memory_limit_finds_a_replicated_stage_of_unconnected_layers() -> None:
    """An example hypothesis found: five unconnected layers, 3 GPUs, one microbatch, 8000 bytes.
    Brute force fits {l3} on one GPU and the other four layers on two replicas (7359 and 6812
    bytes, 83.92 ms); the search says nothing fits under about 8151 bytes. The property test above
    meets the same defect on its fixed draws (five unconnected layers, 4 GPUs, a limit of 8000)."""
    from partitioner.errors import InfeasibleError

    costs = [(4, 5, 848, 1152), (3, 36, 300, 200), (9, 25, 286, 94), (4, 6, 75, 1821), (7, 1, 622, 0)]
    profile, cluster = make_profile(costs, []), Cluster.flat(3, 1e5, 8000)
    assert brute_force(profile, cluster, schedule="gpipe", microbatches=1, optimizer="adam") == pytest.approx(
        0.08392
    )
    try:
        plan = solve(profile, cluster, "gpipe", 1, "adam")
    except InfeasibleError:
        pytest.fail("the search found no plan")
    assert plan.predicted.time_per_minibatch_s == pytest.approx(0.08392)


def test_synchronous_plans_use_a_microbatch_count_every_replica_can_use() -> None:
    """Microbatches go round-robin to a stage's replicas and the cost model prices r replicas at 1/r of
    the stage: a 3-1 plan asked for 2 or 4 microbatches is re-solved at lcm(asked, 3), which the batch
    (12) allows; where it does not (batch 8), the plan keeps the asked count."""
    from partitioner.optimizer import solve
    from partitioner.plan import Cluster
    from tests.partitioner.optimizer.conftest import make_profile

    heavy = [(30, 60, 10, 0), (1, 1, 10, 10**9)]
    for asked, expected in ((2, 6), (4, 12)):
        plan = solve(make_profile(heavy, [(0, 1)], batch_size=12), Cluster.flat(4, 1e9), "1f1b", asked)
        assert plan.microbatches == expected and plan.extra["microbatches_asked"] == asked
        assert all(plan.microbatches % s.replicas == 0 for s in plan.stages)
    kept = solve(make_profile(heavy, [(0, 1)], batch_size=8), Cluster.flat(4, 1e9), "1f1b", 2)
    assert kept.microbatches == 2 and "microbatches_asked" not in kept.extra


chains = st.integers(min_value=2, max_value=5).flatmap(
    lambda n: st.lists(
        st.tuples(st.integers(1, 20), st.integers(1, 40), st.integers(0, 4000), st.integers(0, 3000)),
        min_size=n, max_size=n,
    )
)  # fmt: skip


@settings(max_examples=40, deadline=None, phases=(Phase.explicit, Phase.generate))  # no shrinking: minutes
@given(costs=chains, gpus=st.integers(1, 4), microbatches=st.sampled_from([1, 2, 4]),
       limit=st.integers(6_000, 40_000))  # fmt: skip
def test_1f1b_under_a_memory_limit_is_optimal(
    costs: list[tuple[int, int, int, int]], gpus: int, microbatches: int, limit: int
) -> None:
    """1f1b holds fewer microbatches the later its stage (the stages after it, itself counted): the
    search checks each stage's memory at its depth, so the plan is the best that fits, as brute
    force over every plan finds it, and proven so (or nothing fits, for both)."""
    from partitioner.errors import InfeasibleError

    profile = make_profile(costs, [(i, i + 1) for i in range(len(costs) - 1)])
    cluster = Cluster.flat(gpus, 1e5, limit)
    try:
        plan = solve(profile, cluster, "1f1b", microbatches, "adam")
    except InfeasibleError:
        asked = brute_force(profile, cluster, schedule="1f1b", microbatches=microbatches, optimizer="adam")
        assert asked == math.inf
        return
    expected = brute_force(
        profile, cluster, schedule="1f1b", microbatches=plan.microbatches, optimizer="adam"
    )
    assert searched_s(plan) == pytest.approx(expected, rel=1e-9)
    assert plan.solver.optimal
    assert max(s.memory_bytes for s in plan.stages) <= limit


@settings(max_examples=40, deadline=None, phases=(Phase.explicit, Phase.generate))  # no shrinking: minutes
@given(costs=chains, gpus=st.integers(1, 4), schedule=st.sampled_from(["1f1b", "gpipe"]),
       microbatches=st.sampled_from([1, 2, 4]), recompute=st.sampled_from(["auto", "all"]),
       limit=st.integers(6_000, 40_000))  # fmt: skip
def test_recomputing_under_a_memory_limit_is_optimal(
    costs: list[tuple[int, int, int, int]], gpus: int, schedule: str, microbatches: int, recompute: str,
    limit: int,
) -> None:  # fmt: skip
    """With ``--recompute auto`` a stage recomputes exactly where it does not fit otherwise, and with
    ``all`` every stage does: the search prices each stage both ways, so its plan is the best of every
    plan so priced (brute force), proven, and fits (or nothing fits, for both)."""
    from partitioner.errors import InfeasibleError

    profile = make_profile(costs, [(i, i + 1) for i in range(len(costs) - 1)])
    cluster = Cluster.flat(gpus, 1e5, limit)
    args = {"schedule": schedule, "optimizer": "adam", "recompute": recompute}
    try:
        plan = solve(profile, cluster, schedule, microbatches, "adam", recompute=recompute)
    except InfeasibleError:
        assert brute_force(profile, cluster, microbatches=microbatches, **args) == math.inf
        return
    expected = brute_force(profile, cluster, microbatches=plan.microbatches, **args)
    assert searched_s(plan) == pytest.approx(expected, rel=1e-9)
    assert plan.solver.optimal
    assert max(s.memory_bytes for s in plan.stages) <= limit


def test_gnmt_under_a_tight_limit_1f1b_is_proven_with_and_without_recomputing() -> None:
    """PipeDream's GNMT-16 on 4 GPUs under 95% of the memory its fastest adam plan takes (the golden
    cases ``extra/gnmt/1f1b/adam@0.95/recompute-*``). Holding all 8 microbatches on every stage,
    the search found 53.17 ms without recomputing, not proven; at each stage's depth it proves
    52.29 ms. Every stage recomputing, the search on a profile that keeps nothing found a plan whose
    last stage needs more than the limit, and said no plan fits; priced as it runs, one does."""
    from tests.partitioner.optimizer.golden import _recomputing, _tight

    limit = _tight("gnmt", "1f1b", 0.95).memory_bytes
    kept = _recomputing("gnmt", "1f1b", 0.95, "none")
    assert kept.solver.optimal and kept.predicted.time_per_minibatch_s < 0.0531
    every = _recomputing("gnmt", "1f1b", 0.95, "all")
    assert every.solver.optimal and all(s.recompute for s in every.stages)
    assert limit is not None and max(s.memory_bytes for s in every.stages) <= limit
