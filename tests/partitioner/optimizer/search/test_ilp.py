"""DP and ILP agree on small cases."""

from __future__ import annotations

import sys
import warnings
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.optimizer import solve
from partitioner.optimizer.search.ilp import _backend
from partitioner.plan import Cluster
from tests.partitioner.optimizer.conftest import make_profile, searched_s
from tests.partitioner.optimizer.search.test_dp import ACTIONS, dags


@settings(max_examples=12, deadline=None)
@given(dag=dags, gpus=st.integers(1, 4), action=ACTIONS)
def test_dp_equals_ilp(
    dag: tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]], gpus: int, action: float
) -> None:
    costs, raw = dag
    profile = make_profile(costs, [(a, b) for a, b in raw if a < b])
    cluster = replace(Cluster.flat(gpus, bandwidth=1e5), action_s=action)
    dp = solve(profile, cluster).predicted.time_per_minibatch_s
    ilp = solve(profile, cluster, solver="ilp")
    assert ilp.solver.name == "ilp"
    assert ilp.predicted.time_per_minibatch_s == pytest.approx(dp, rel=1e-6)


def test_ilp_on_a_real_profile() -> None:
    from partitioner.graph import read_graph_txt
    from tests.data import PIPEDREAM_PROFILES

    path = PIPEDREAM_PROFILES / "alexnet" / "graph.txt"
    profile = read_graph_txt(path, 256)
    for gpus in (2, 4):
        dp = solve(profile, Cluster.flat(gpus)).predicted.time_per_minibatch_s
        ilp = solve(profile, Cluster.flat(gpus), solver="ilp").predicted.time_per_minibatch_s
        assert ilp == pytest.approx(dp, rel=1e-6)


@settings(max_examples=12, deadline=None)
@given(dag=dags, gpus=st.integers(1, 4), schedule=st.sampled_from(["1f1b", "gpipe"]),
       microbatches=st.sampled_from([1, 3, 8]), action=ACTIONS)  # fmt: skip
def test_dp_equals_ilp_for_synchronous_schedules(
    dag: tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]],
    gpus: int,
    schedule: str,
    microbatches: int,
    action: float,
) -> None:
    """The branch and bound and the MILP (sum + (M-1)·t + a, t and a as epigraph variables) agree,
    with or without the runtime's time per action."""
    costs, raw = dag
    profile = make_profile(costs, [(a, b) for a, b in raw if a < b])
    cluster = replace(Cluster.flat(gpus, bandwidth=1e5), action_s=action)
    dp = searched_s(solve(profile, cluster, schedule, microbatches))
    ilp = solve(profile, cluster, schedule, microbatches, solver="ilp")
    assert ilp.solver.name == "ilp"
    assert searched_s(ilp) == pytest.approx(dp, rel=1e-6)  # (ties may simulate apart)


@pytest.mark.parametrize("highs", [True, False])
def test_the_ilp_warns_nothing(highs: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """PuLP 3 deprecates its bundled CBC: with highspy the ILP uses HiGHS; without it, whatever CBC it
    falls back to, the solve prints no DeprecationWarning into the user's output."""
    if not highs:
        monkeypatch.setitem(sys.modules, "highspy", None)  # (import highspy now raises ImportError)
    profile = make_profile([(0, 1, 1, 1), (1, 2, 2, 1), (1, 1, 1, 1)], [(0, 1), (1, 2)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = _backend()
        plan = solve(profile, Cluster.flat(2), solver="ilp")
    assert (backend.name == "HiGHS") == highs
    assert backend.available()
    assert plan.solver.name == "ilp"
    assert [str(w.message) for w in caught] == []
