"""The lattice search's building blocks against direct definitions (downsets, covers, sums)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.graph import Profile
from partitioner.optimizer.search.lattice import enumerate_lattice
from partitioner.optimizer.search.states import downset_states
from partitioner.plan import Link
from tests.partitioner.optimizer.conftest import make_profile

wide_dags = st.integers(min_value=1, max_value=9).flatmap(
    lambda n: st.tuples(
        st.lists(
            st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(0, 5000), st.integers(0, 9000)),
            min_size=n,
            max_size=n,
        ),
        st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=2 * n),
    )
)


def _reference(profile: Profile) -> dict[frozenset[int], tuple[float, float, float]]:
    """Every downset (as layer indices) with compute, params and bytes leaving it, by definition."""
    layers = [n for n in profile.nodes if n.op != "input"]
    index = {n.id: i for i, n in enumerate(layers)}
    preds = [{index[s] for s in n.inputs if s in index} for n in layers]
    out: dict[frozenset[int], tuple[float, float, float]] = {}
    for size in range(len(layers) + 1):
        for combo in itertools.combinations(range(len(layers)), size):
            chosen = frozenset(combo)
            if any(not preds[i] <= chosen for i in chosen):
                continue
            leaving = sum(
                float(layers[i].output_bytes)
                for i in chosen
                if any(i in preds[t] and t not in chosen for t in range(len(layers)))
            )
            out[chosen] = (
                sum(layers[i].compute_ms / 1000.0 for i in chosen),
                sum(float(layers[i].param_bytes) for i in chosen),
                leaving,
            )
    return out


def _as_set(row: np.ndarray, width: int) -> frozenset[int]:
    return frozenset(i for i in range(width) if int(row[i // 64]) >> (i % 64) & 1)


@settings(max_examples=60, deadline=None)
@given(dag=wide_dags)
def test_lattice_holds_every_downset_with_its_covers_and_sums(
    dag: tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]],
) -> None:
    costs, raw = dag
    profile = make_profile(costs, [(a, b) for a, b in raw if a < b])
    lat = enumerate_lattice(profile, 10_000)
    assert lat is not None
    width = len(lat.layer_ids)
    sets = [_as_set(row, width) for row in lat.masks]
    ref = _reference(profile)
    assert len(sets) == len(set(sets)) == len(ref) and set(sets) == set(ref)
    assert sets[0] == frozenset() and len(sets[-1]) == width
    position = {s: i for i, s in enumerate(sets)}
    for size in range(len(lat.starts) - 1):
        assert all(len(s) == size for s in sets[lat.starts[size] : lat.starts[size + 1]])
    for j, s in enumerate(sets):
        assert (lat.compute_s[j], lat.param_bytes[j], lat.act_bytes[j]) == pytest.approx(ref[s])
        covers = lat.cover_idx[lat.cover_ptr[j] : lat.cover_ptr[j + 1]]
        expected = {position[s - {x}] for x in s if s - {x} in position}  # minus one maximal layer
        assert sorted(covers.tolist()) == sorted(expected) and len(covers) == len(expected)


def test_lattice_beyond_one_word_matches_the_pair_states() -> None:
    """Masks wider than 64 layers (several words per row): same downsets as the pair DP's states."""
    half = 45  # two parallel chains of 45 layers joined by a last layer: 46 * 46 + 1 downsets
    costs = [(1 + i % 7, 2 + i % 5, 100 * (i % 9), 1000 * (i % 4)) for i in range(2 * half + 1)]
    edges = [(i, i + 1) for i in range(2 * half - 1) if i != half - 1] + [
        (half - 1, 2 * half),
        (2 * half - 1, 2 * half),
    ]
    profile = make_profile(costs, edges)
    lat = enumerate_lattice(profile, 100_000)
    states = downset_states(profile, 100_000)
    assert lat is not None and states is not None
    width = len(lat.layer_ids)
    mine = {_as_set(row, width): j for j, row in enumerate(lat.masks)}
    theirs = {frozenset(i for i in range(width) if m >> i & 1): j for j, m in enumerate(states.masks)}
    assert set(mine) == set(theirs) and len(mine) == 46 * 46 + 1
    for s, j in mine.items():
        k = theirs[s]
        assert lat.compute_s[j] == pytest.approx(states.compute_s[k])
        assert lat.act_bytes[j] == states.act_bytes[k]
        assert set(lat.members(0, j)) == {lat.layer_ids[i] for i in s}


def test_lattice_gives_up_beyond_its_caps() -> None:
    profile = make_profile([(1, 1, 10, 10)] * 12, [])  # 12 independent layers: 4,096 downsets
    assert enumerate_lattice(profile, 1000) is None
    assert enumerate_lattice(profile, 10_000, max_layer=500) is None
    lat = enumerate_lattice(profile, 10_000)
    assert lat is not None and len(lat.masks) == 4096


@settings(max_examples=60, deadline=None)
@given(
    dag=wide_dags,
    gpus=st.integers(1, 8),
    scale=st.floats(0.05, 1.5),
    bandwidth=st.sampled_from([1e3, 1e5, 1e7]),
    straight=st.booleans(),
    latency=st.sampled_from([0.0, 1e-3, 2e-2]),
    sync=st.sampled_from([(None, None), (3e4, 2e-3), (4e5, 0.0)]),
)
def test_banded_probe_equals_full_probe(
    dag: tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]],
    gpus: int,
    scale: float,
    bandwidth: float,
    straight: bool,
    latency: float,
    sync: tuple[float | None, float | None],
) -> None:
    """Dropping (replicas, devices) pairs below the compute floor never changes a probe's answer."""
    from partitioner.optimizer.search.lattice import _probe, _Sweep, _weights

    costs, raw = dag
    lat = enumerate_lattice(make_profile(costs, [(a, b) for a, b in raw if a < b]), 10_000)
    assert lat is not None
    cap = 1 if straight else gpus
    link = Link(bandwidth, latency, *sync)
    weights = _weights(lat, np.arange(1, cap + 1, dtype=np.float64), link)
    tau = scale * float(lat.compute_s[-1])
    sweep = _Sweep.of(lat)
    full = _probe(lat, sweep, gpus, link, tau, weights, band=False)
    banded = _probe(lat, sweep, gpus, link, tau, weights)
    assert np.array_equal(full, banded)


def test_plan_start_maps_onto_the_lattice() -> None:
    """The pair search's plan, renumbered onto the lattice, keeps its cuts (same downsets)."""
    from partitioner.optimizer.search.bottleneck import _on_lattice
    from partitioner.optimizer.search.dp import Segment

    profile = make_profile([(1, 2, 10, 10)] * 6, [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4), (3, 5)])
    lat, states = enumerate_lattice(profile, 1000), downset_states(profile)
    assert lat is not None and states is not None
    last = len(states) - 1
    mid = next(j for j in range(1, last) if bin(states.masks[j]).count("1") == 3)
    mapped = _on_lattice(states, lat, [Segment(0, mid, 2), Segment(mid, last, 1)])
    assert mapped is not None
    assert [s.replicas for s in mapped] == [2, 1] and mapped[-1].end == len(lat.masks) - 1
    assert lat.members(0, mapped[0].end) == states.members(0, mid)
