"""Fewest devices per state, both ways, against a plain dynamic program over the same stages."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.optimizer.search.reach import fewest_units, fewest_units_after
from partitioner.optimizer.search.states import build_states
from tests.partitioner.optimizer.conftest import make_profile

dags = st.integers(min_value=1, max_value=7).flatmap(
    lambda n: st.tuples(
        st.just(n),
        st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=2 * n),
        st.lists(st.sampled_from([1.0, 1.0, 2.0, 3.0, math.inf]), min_size=400, max_size=400),
    )
)


@settings(max_examples=80, deadline=None)
@given(dag=dags, most=st.integers(1, 6))
def test_fewest_units_both_ways_equal_a_plain_dp(dag: tuple[int, list[tuple[int, int]], list[float]],
                                                 most: int) -> None:  # fmt: skip
    """Layer by layer exactly; by rounds exactly up to ``most`` (larger values may come out larger)."""
    n, raw, needs = dag
    states = build_states(make_profile([(1, 1, 10, 10)] * n, [(a, b) for a, b in raw if a < b]))
    ks, js = states.all_pairs()
    need = np.array((needs * (len(ks) // len(needs) + 1))[: len(ks)], dtype=np.float64)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(js, minlength=len(states)))]).astype(np.int64)
    layers = states.size_layers()
    forward, backward = [math.inf] * len(states), [math.inf] * len(states)
    forward[0], backward[-1] = 0.0, 0.0
    for j in range(len(states)):  # states are ordered by size: every stage into j is settled
        for k, r in zip(ks[js == j], need[js == j], strict=True):
            forward[j] = min(forward[j], forward[k] + r)
    for k in reversed(range(len(states))):
        for j, r in zip(js[ks == k], need[ks == k], strict=True):
            backward[k] = min(backward[k], backward[j] + r)
    assert fewest_units(ks, offsets, layers, need).tolist() == forward
    assert fewest_units_after(ks, js, layers, need).tolist() == backward
    for got, want in ((fewest_units(ks, offsets, layers, need, most), forward),
                      (fewest_units_after(ks, js, layers, need, most), backward)):  # fmt: skip
        small = np.array(want) <= most
        assert np.array_equal(got[small], np.array(want)[small]) and (got[~small] > most).all()
