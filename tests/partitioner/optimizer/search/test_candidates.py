"""The baselines other tools pick: every plan covers the whole model, and none beats the optimizer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.graph import Node
from partitioner.optimizer import solve
from partitioner.optimizer.planner import alternatives as baselines
from partitioner.plan import Cluster
from tests.partitioner.optimizer.conftest import make_profile


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b"])
def test_every_baseline_holds_every_node_the_loss_included(schedule: str) -> None:
    chain = make_profile([(4, 8, 100, 100), (1, 2, 100, 100)] * 3, [(i, i + 1) for i in range(5)])
    loss = Node("output", "output", "output", "output", ("l5",), 3.0, 3.0)  # the loss has a time too
    profile = replace(chain, nodes=(*chain.nodes, loss))
    cluster = Cluster.flat(2)
    best = solve(profile, cluster, schedule, 1 if schedule == "pipedream" else 4)
    for name, plan in baselines(
        profile, cluster, schedule, 1 if schedule == "pipedream" else 4, "sgd"
    ).items():
        assert plan is not None
        assert sorted(n for s in plan.stages for n in s.nodes) == sorted(n.id for n in profile.nodes), name
        assert best.predicted.time_per_minibatch_s <= plan.predicted.time_per_minibatch_s * (1 + 1e-9), name


def test_balancing_methods_take_the_data_parallel_width_their_users_would() -> None:
    """Eight equal layers, light weights, a fast link on 4 GPUs: one GPU per stage pays a pipeline's
    start-up for nothing; two stages of two replicas, or data parallelism, is what a DeepSpeed user
    runs. The hybrid is the fastest width that divides the GPUs, never slower than width 1."""
    from partitioner.optimizer.search.candidates import best_width, parameter_balanced

    profile = make_profile([(4, 8, 10, 10)] * 8, [(i, i + 1) for i in range(7)])
    cluster = Cluster.flat(4, bandwidth=1e12)
    chosen = baselines(profile, cluster, "1f1b", 4, "sgd")["parameter balanced"]
    assert chosen is not None
    widths = {s.replicas for s in chosen.stages}
    assert widths != {1} and len(widths) == 1 and len(chosen.stages) * widths.pop() == 4
    each = {w: parameter_balanced(profile, cluster, "1f1b", 4, "sgd", width=w) for w in (1, 2, 4)}
    fastest = min(p.predicted.time_per_minibatch_s for p in each.values())
    assert chosen.predicted.time_per_minibatch_s == pytest.approx(fastest)
    assert fastest < each[1].predicted.time_per_minibatch_s
    hybrid = best_width(lambda w: parameter_balanced(profile, cluster, "1f1b", 4, "sgd", width=w), 4)
    assert hybrid.predicted.time_per_minibatch_s == pytest.approx(fastest)
