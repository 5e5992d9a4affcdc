"""State sets: the prefix-order subset lists against the direct pairwise mask test."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.optimizer.search.states import (
    _boundary,
    _layers,
    _subset_preds,
    _sums,
    downset_states,
    downsets_at_least,
    multi_order_states,
    thin_prefixes,
)
from tests.partitioner.optimizer.conftest import make_profile

wide_dags = st.integers(min_value=2, max_value=12).flatmap(
    lambda n: st.tuples(
        st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(0, 99), st.integers(0, 99)),
                 min_size=n, max_size=n),
        st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=2 * n),
    )
)  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(dag=wide_dags)
def test_prefix_preds_equal_pairwise_subset_tests(
    dag: tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]],
) -> None:
    """Prefixes of several orders: the running-position shortcut lists exactly the strict subsets,
    and the running sums along each order equal the sums over each state's members."""
    costs, raw = dag
    profile = make_profile(costs, [(a, b) for a, b in raw if a < b])
    states = multi_order_states(profile, max_layers=100)
    ids, _, succs = _layers(profile)
    comp, par, sav, mat = _sums(profile, ids, list(states.masks))  # running sums = matrix sums
    leaving = _boundary(profile, ids, succs, mat).T
    for want, got in ((comp, states.compute_s), (par, states.param_bytes), (sav, states.saved_bytes),
                      (leaving[0], states.act_bytes), (leaving[1], states.sent_bytes),
                      (leaving[2], states.received_bytes)):  # fmt: skip
        assert np.allclose(want, got, rtol=1e-12, atol=0.0)
    if states.preds is None:  # a chain: every earlier state is a subset
        assert all(a & b == a for a, b in zip(states.masks, states.masks[1:], strict=False))
        return
    expected = _subset_preds(list(states.masks), len(states.layer_ids))
    assert len(expected) == len(states)
    for j, want in enumerate(expected):
        assert np.array_equal(want, states.pred(j))
    assert states.pair_count() == sum(len(p) for p in expected)
    need = np.array([m.bit_count() % 3 for m in states.masks])
    room = np.array([m.bit_count() % 4 - 1 for m in states.masks])
    for size in (1, 7, 1 << 20):  # blocks of any size, only pairs with need[k] <= room[j], grouped by j
        blocks = list(states.pair_blocks(size, (need, room)))
        pairs = [(int(j), int(k)) for ks, js in blocks for k, j in zip(ks, js, strict=True)]
        assert [j for j, _ in pairs] == sorted(j for j, _ in pairs)
        kept = [(j, int(k)) for j, p in enumerate(expected) for k in p if need[k] <= room[j]]
        assert sorted(pairs) == kept
    thin = thin_prefixes(states, 2)  # a subset of the states keeps its subsets as runs too
    if thin is not None:
        assert set(thin.masks) < set(states.masks) and thin.masks[0] == 0
        for j, want in enumerate(_subset_preds(list(thin.masks), len(thin.layer_ids))):
            assert np.array_equal(want, thin.pred(j))


@settings(max_examples=80, deadline=None)
@given(dag=wide_dags)
def test_downset_lower_bound_never_exceeds_the_count(
    dag: tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]],
) -> None:
    """The incomparable-chains bound that lets the listings give up early is a true lower bound."""
    costs, raw = dag
    profile = make_profile(costs, [(a, b) for a, b in raw if a < b])
    _, preds, succs = _layers(profile)
    every = downset_states(profile, 10**6)
    assert every is not None and 1 <= downsets_at_least(preds, succs, 10**9) <= len(every)
