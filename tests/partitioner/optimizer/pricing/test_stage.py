"""The one stage-time function: its vectorised form is its scalar form, elementwise and to the bit,
and the searches price stages with it (the pair DP's candidates, the synchronous search's choices,
a plan's own cost model)."""

from __future__ import annotations

import numpy as np

from partitioner.graph import read_graph_txt
from partitioner.optimizer.pricing.price import StageSpec, assemble
from partitioner.optimizer.pricing.stage import microbatch_time, stage_time
from partitioner.optimizer.search.dp import LevelProblem, _Pairs
from partitioner.optimizer.search.states import build_states
from partitioner.optimizer.search.sync import _Choices
from partitioner.plan import Cluster, Link, SolverInfo
from tests.data import PIPEDREAM_PROFILES

RNG = np.random.default_rng(7)
N = 2000
COMPUTE = RNG.uniform(0.0, 0.2, N)
PARAMS = RNG.integers(0, 1 << 28, N).astype(np.float64)
ACT = RNG.integers(0, 1 << 26, N).astype(np.float64)
REPLICAS = RNG.integers(1, 17, N)
INNER = RNG.integers(1, 5, N)


def test_stage_time_vectorised_is_its_scalar_form_to_the_bit() -> None:
    for inner in (1, 4):
        many = stage_time(COMPUTE, PARAMS, REPLICAS, Link(1.25e9, 2e-3), inner, ACT)
        one = [float(stage_time(float(c), float(p), int(r), Link(1.25e9, 2e-3), inner, float(a)))
               for c, p, r, a in zip(COMPUTE, PARAMS, REPLICAS, ACT, strict=True)]  # fmt: skip
        assert many.tolist() == one


def test_microbatch_time_vectorised_is_its_scalar_form_to_the_bit() -> None:
    for m in (1, 3, 8):
        many = microbatch_time(COMPUTE, ACT, REPLICAS.astype(np.float64), m, Link(1e9, 2e-3))
        one = [microbatch_time(float(c), float(a), int(r), m, Link(1e9, 2e-3))
               for c, a, r in zip(COMPUTE, ACT, REPLICAS, strict=True)]  # fmt: skip
        assert many.tolist() == one


def test_the_pair_search_prices_stages_as_the_plan_does() -> None:
    profile = read_graph_txt(PIPEDREAM_PROFILES / "vgg16" / "graph.txt", 128)
    states = build_states(profile)
    prob = LevelProblem(states, 8, Link(1e9))
    pairs = _Pairs.of(prob)
    idx = np.arange(0, len(pairs.ks), 7)
    for r in (1, 2, 5):
        got = pairs.times_of(idx, np.full(len(idx), float(r)))
        ks, js = pairs.ks[idx], pairs.js()[idx]
        compute, params = (
            states.compute_s[js] - states.compute_s[ks],
            states.param_bytes[js] - states.param_bytes[ks],
        )
        want = stage_time(compute, params, r, Link(1e9), act=pairs.act[idx])
        assert got.tolist() == want.tolist()
    k, j = 3, 11  # one stage as a plan prices it: the slowest stage of a one-stage-each plan
    nodes = states.members(0, k), states.members(k, j), states.members(j, len(states) - 1)
    specs = [StageSpec(tuple(n), 1, (i,)) for i, n in enumerate(nodes)]
    plan = assemble(profile, Cluster.flat(3, 1e9), specs, "pipedream", 1, "sgd", SolverInfo("t", 0, False))
    assert plan.predicted.pipeline_s == max(
        prob.stage_time(a, b, 1) for a, b in ((0, k), (k, j), (j, len(states) - 1))
    )


def test_the_synchronous_search_prices_microbatches_as_the_plan_does() -> None:
    profile = read_graph_txt(PIPEDREAM_PROFILES / "alexnet" / "graph.txt", 128)
    states = build_states(profile)
    choices = _Choices.of(states, 4, Link(1e9), 8)
    out = np.where(choices.j < len(states) - 1, states.act_bytes[choices.j], 0.0)
    compute = states.compute_s[choices.j] - states.compute_s[choices.k]
    for r in (1, 2, 4):
        assert choices.u[:, r - 1].tolist() == microbatch_time(compute, out, float(r), 8, Link(1e9)).tolist()
