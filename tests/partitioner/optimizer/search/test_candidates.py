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
