"""PipeDream's level-by-level recursion against an independent brute force on tiny DAGs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.graph import Profile
from partitioner.optimizer import solve
from partitioner.plan import Cluster, Level, Link
from tests.partitioner.optimizer.conftest import make_profile
from tests.partitioner.optimizer.search.test_dp import LATENCIES, SYNCS, _downsets, dags

Down = frozenset[str]


def _sums(profile: Profile, d: Down) -> tuple[float, float, float]:
    """Compute seconds, parameter bytes, and bytes leaving the downset."""
    nodes = {n.id: n for n in profile.nodes}
    comp = sum(nodes[i].compute_ms for i in d) / 1000.0
    params = float(sum(nodes[i].param_bytes for i in d))
    leaving = {s for n in profile.nodes if n.id not in d and n.op != "input" for s in n.inputs if s in d}
    return comp, params, float(sum(nodes[s].output_bytes for s in leaving))


def _chains(downs: list[Down], start: Down, end: Down, most: int) -> list[list[Down]]:
    """Every chain start < d1 < ... < end with at most ``most`` steps."""
    if most == 0:
        return []
    out = [[start, end]] if start < end else []
    for d in downs:
        if start < d < end:
            out += [[start, *rest] for rest in _chains(downs, d, end, most - 1)]
    return out


def _splits(parts: int, budget: int) -> list[list[int]]:
    if parts == 0:
        return [[]]
    return [[r, *rest] for r in range(1, budget - parts + 2) for rest in _splits(parts - 1, budget - r)]


def _level_best(profile, downs, start, end, units, bw, inner, base, full) -> float:  # type: ignore[no-untyped-def]
    """Best time of segment (start, end] on ``units`` units of one level; internal cuts charged here."""
    best = math.inf
    for chain in _chains(downs, start, end, units):
        for reps in _splits(len(chain) - 1, units):
            worst = 0.0
            for i, r in enumerate(reps):
                a, b = chain[i], chain[i + 1]
                c = base(a, b)
                p = _sums(profile, b)[1] - _sums(profile, a)[1]
                t = (c + 4 * (r - 1) * p / (r * bw) / inner) / r
                cut_in = _sums(profile, a)[2] if i > 0 else 0.0
                cut_out = _sums(profile, b)[2] if i < len(reps) - 1 else 0.0
                worst = max(worst, t, 2 * cut_in / (bw * r), 2 * cut_out / (bw * r))
            best = min(best, worst)
    return best


def brute_two_levels(profile: Profile, n1: int, b1: float, n2: int, b2: float) -> float:
    downs = _downsets(profile)
    empty, full = downs[0], downs[-1]

    def compute(a: Down, b: Down) -> float:
        return _sums(profile, b)[0] - _sums(profile, a)[0]

    def inner(a: Down, b: Down) -> float:
        return _level_best(profile, downs, a, b, n1, b1, 1, compute, full)

    return _level_best(profile, downs, empty, full, n2, b2, n1, inner, full)


@settings(max_examples=25, deadline=None)
@given(dag=dags.filter(lambda d: len(d[0]) <= 4), n1=st.integers(1, 2), n2=st.integers(1, 3))
def test_two_levels_equal_brute_force(
    dag: tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]], n1: int, n2: int
) -> None:
    costs, raw = dag
    profile = make_profile(costs, [(a, b) for a, b in raw if a < b])
    b1, b2 = 4e5, 1e5
    plan = solve(profile, Cluster((Level(n1, b1), Level(n2, b2))))
    assert plan.predicted.time_per_minibatch_s == pytest.approx(
        brute_two_levels(profile, n1, b1, n2, b2), rel=1e-8
    )
    assert sum(s.replicas for s in plan.stages) <= n1 * n2
    assert sorted(r for s in plan.stages for r in s.ranks) == sorted(
        set(r for s in plan.stages for r in s.ranks)
    )


@settings(max_examples=30, deadline=None)
@given(
    dag=dags,
    n1=st.integers(1, 3),
    n2=st.integers(1, 3),
    slack=st.sampled_from([0.0, 1e-12, 0.2]),
    latency=LATENCIES,
)
def test_table_ceiling_keeps_the_optimum(
    dag: tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]],
    n1: int,
    n2: int,
    slack: float,
    latency: float,
) -> None:
    """Inner tables cut at a ceiling from an attained time (even the optimum itself) lose nothing."""
    from partitioner.optimizer.search.hierarchy import _solve_levels
    from partitioner.optimizer.search.states import build_states

    costs, raw = dag
    states = build_states(make_profile(costs, [(a, b) for a, b in raw if a < b]))
    levels = [(n1, Link(4e5, latency / 4)), (n2, Link(1e5, latency))]
    best, _, _ = _solve_levels(states, levels, None, math.inf)
    bounded, stages, _ = _solve_levels(states, levels, None, best * (1 + slack))
    assert bounded == best
    assert sum(s.replicas * sum(x.replicas for x in s.inner) for s in stages) <= n1 * n2


@settings(max_examples=40, deadline=None)
@given(
    dag=dags,
    units=st.lists(st.integers(1, 3), min_size=2, max_size=3),
    top_bw=st.sampled_from([1e3, 1e5, 1e7]),
    slack=st.sampled_from([0.0, 1e-12, 0.05]),
    latency=LATENCIES,
    sync=SYNCS,
)
def test_sync_aware_ceilings_keep_the_optimum(
    dag: tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]],
    units: list[int],
    top_bw: float,
    slack: float,
    latency: float,
    sync: tuple[float | None, float | None],
) -> None:
    """Ceilings that charge a top stage its gradient sync (slow top links: sync dominates) lose nothing."""
    from partitioner.optimizer.search.hierarchy import _solve_levels
    from partitioner.optimizer.search.states import build_states

    costs, raw = dag
    states = build_states(make_profile(costs, [(a, b) for a, b in raw if a < b]))
    levels = [(n, Link(4e5)) for n in units[:-1]] + [(units[-1], Link(top_bw, latency, *sync))]
    best, _, _ = _solve_levels(states, levels, None, math.inf)
    bounded, _, _ = _solve_levels(states, levels, None, best * (1 + slack))
    assert bounded == best


@pytest.mark.parametrize("name", ["gnmt", "gnmt_large", "inception_v3", "nasnetamobile", "resnet18"])
def test_hierarchy_states_are_build_states_thinned(name: str) -> None:
    """Hierarchies search build_states' states, or beyond 600 each order's prefixes thinned to 200
    (skipping no shortcut): a subset of the flat search's states that keeps its layer-order chain."""
    from partitioner.graph import read_graph_txt
    from partitioner.optimizer.search.plans import HIERARCHY_MAX_STATES, HIERARCHY_THIN_STATES
    from partitioner.optimizer.search.plans import hierarchy_states as _hierarchy_states
    from partitioner.optimizer.search.states import (
        build_states,
        chain_states,
        multi_order_states,
        without_free_sinks,
    )
    from tests.data import PIPEDREAM_PROFILES

    profile = without_free_sinks(read_graph_txt(PIPEDREAM_PROFILES / name / "graph.txt"))
    full, got = build_states(profile), _hierarchy_states(profile)
    if len(full) <= HIERARCHY_MAX_STATES:
        assert got.masks == full.masks
        return
    assert len(got) <= HIERARCHY_MAX_STATES
    assert set(got.masks) <= set(multi_order_states(profile).masks)
    assert set(chain_states(profile, HIERARCHY_THIN_STATES).masks) <= set(got.masks)


@settings(max_examples=40, deadline=None)
@given(dag=dags, units=st.integers(1, 4), bandwidth=st.sampled_from([1e3, 1e5, 1e7]), latency=LATENCIES)
def test_segment_tables_equal_plain_recurrence(
    dag: tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]],
    units: int,
    bandwidth: float,
    latency: float,
) -> None:
    """The pruned table fill (splits and rows that cannot beat a row's best are skipped) equals the
    plain recurrence over every start, split and replica count, entry for entry, whichever way the
    splits are listed (compute windows, value-ordered columns, or the cheaper per end)."""
    import numpy as np

    from partitioner.optimizer.search import hierarchy
    from partitioner.optimizer.search.dp import LevelProblem
    from partitioner.optimizer.search.hierarchy import _all_segments, _segment_grids
    from partitioner.optimizer.search.states import build_states

    costs, raw = dag
    states = build_states(make_profile(costs, [(a, b) for a, b in raw if a < b]))
    prob = LevelProblem(states, units, Link(bandwidth, latency))
    tables = _all_segments(prob)
    for search in ("window", "column"):
        other = _all_segments(prob, search=search)
        assert np.array_equal(other.opened, tables.opened) and np.array_equal(other.closed, tables.closed)
    saved = hierarchy.COLUMN_RATIO
    try:  # "auto" choosing per end j on every fold, not only where windows are crowded
        hierarchy.COLUMN_RATIO = -1
        other = _all_segments(prob)
    finally:
        hierarchy.COLUMN_RATIO = saved
    assert np.array_equal(other.opened, tables.opened) and np.array_equal(other.closed, tables.closed)
    n, sub = len(states), states.subset_matrix()
    opened = np.full((units, n, n), np.inf)
    for j in range(1, n):
        for m in range(1, units + 1):
            out = m < units
            for i in states.pred(j):
                one = np.array([i])
                best = min(float(_segment_grids(prob, j, one, np.array([[float(r)]]))[out, False][0, 0])
                           for r in range(1, m + 1))  # fmt: skip
                for r in range(1, m):
                    for k in states.pred(j):
                        if sub[i, k]:
                            grids = _segment_grids(prob, j, np.array([k]), np.array([[float(r)]]))
                            last = float(grids[out, True][0, 0])
                            best = min(best, max(opened[m - r, i, k], last))
                if out:
                    opened[m, i, j] = best
                    assert tables.opened[m, i, j] == best
                else:
                    assert tables.closed[i, j] == best
