"""Cluster presets and files: what `partition --cluster` plans for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner.errors import PipeplanError, PlanError
from partitioner.hardware.clusters import NODES, default_latency, levels_of, load_cluster
from partitioner.optimizer.units import parse_latency
from partitioner.plan import Cluster, Level, Link, load_plan, plan_from_json, plan_to_json


def test_a_preset_times_nodes_is_a_two_level_cluster() -> None:
    nvlink, network = Level(8, 450e9, 3.4e-6), Level(8, 50e9, 9.6e-6)  # NCCL's per-step estimates
    assert load_cluster("dgx-h100:8") == Cluster((nvlink, network), 80 * 2**30)
    assert load_cluster("dgx-h100") == Cluster((nvlink,), 80 * 2**30)  # one node: NVLink only
    assert load_cluster("dgx-a100:2").levels[1].bandwidth == 25e9
    assert load_cluster("hgx-h200:4").memory_bytes == 141 * 10**9
    assert all(node.sources and node.device_model for node in NODES.values())


def test_a_cluster_file(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    doc = {
        "schema": "pipeplan.cluster/1",
        "levels": [{"devices": 4, "bandwidth": "300GB/s"}, {"devices": 2, "bandwidth": "100Gbit/s"}],
        "memory": "40GiB",
    }
    path.write_text(json.dumps(doc))
    assert load_cluster(str(path)) == Cluster((Level(4, 300e9), Level(2, 12.5e9)), 40 * 2**30)
    doc["levels"][1]["latency"] = "12us"
    path.write_text(json.dumps(doc))
    assert load_cluster(str(path)).levels[1] == Level(2, 12.5e9, 12e-6)
    path.write_text(json.dumps({**doc, "levels": [{"devices": 4, "bandwidth": "1e9", "latency": "soon"}]}))
    with pytest.raises(PlanError, match="bad latency 'soon'"):
        load_cluster(str(path))
    del doc["levels"][1]["latency"]
    path.write_text(json.dumps({**doc, "levels": [{"devices": 4}]}))
    with pytest.raises(PlanError, match="each level needs devices and bandwidth"):
        load_cluster(str(path))
    path.write_text(json.dumps({**doc, "gpus": 8}))
    with pytest.raises(PlanError, match="unknown field 'gpus'"):
        load_cluster(str(path))


def test_bad_cluster_names() -> None:
    with pytest.raises(PipeplanError, match="dgx-a100, dgx-h100, hgx-h200"):
        load_cluster("dgx-h200")
    with pytest.raises(PlanError, match="node count"):
        load_cluster("dgx-h100:eight")
    with pytest.raises(PlanError, match="at least 1 node"):
        load_cluster("dgx-h100:0")


def test_latencies_are_read_with_units() -> None:
    assert parse_latency("5us") == pytest.approx(5e-6)
    assert parse_latency("1.7ms") == pytest.approx(1.7e-3)
    assert parse_latency("2e-3") == pytest.approx(2e-3)  # a bare number is seconds
    assert parse_latency("0") == 0.0
    for bad in ("-1ms", "fast", "5 parsecs"):
        with pytest.raises(PlanError, match="bad latency"):
            parse_latency(bad)


def test_topology_levels_take_a_latency_each() -> None:
    levels = levels_of([4, 2], "10GB/s,1GB/s", "5us,1.7ms", 0.0)
    assert [lv.link for lv in levels] == [Link(10e9, 5e-6), Link(1e9, 1.7e-3)]
    assert [lv.latency for lv in levels_of([4, 2], None, None, 1e-3)] == [1e-3, 1e-3]
    with pytest.raises(PlanError, match="--latency has 1 values but the topology has 2 levels"):
        levels_of([4, 2], None, "5us", 0.0)
    assert default_latency("cpu") == 1.7e-3 and default_latency("cuda") == 5.7e-6


def test_a_plan_keeps_its_latencies(tmp_path: Path) -> None:
    """plan.json says a level's latency where it has one (older plans: none, read as 0)."""
    from partitioner.optimizer import solve
    from partitioner.plan import save_plan
    from tests.partitioner.optimizer.conftest import make_profile

    profile = make_profile([(5, 10, 4000, 1000), (8, 16, 2000, 2000)], [(0, 1)])
    plan = solve(profile, Cluster((Level(2, 1e9, 2e-3),)))
    levels = list(plan_to_json(plan)["cluster"]["levels"])
    assert levels == [{"devices": 2, "bandwidth": 1e9, "latency": 2e-3}]
    assert load_plan(save_plan(plan, tmp_path / "plan.json")).cluster == plan.cluster
    free = solve(profile, Cluster.flat(2))
    assert "latency" not in plan_to_json(free)["cluster"]["levels"][0]
    assert plan_from_json(plan_to_json(free)).cluster.levels[0].latency == 0.0
    with pytest.raises(PlanError, match="latency must be >= 0"):
        Cluster((Level(2, 1e9, -1.0),))


def test_a_cluster_file_may_price_the_allreduce_apart(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    level = {"devices": 2, "bandwidth": "1.5GB/s", "latency": "200us",
             "allreduce_bandwidth": "2.4GB/s", "allreduce_latency": "0.8ms"}  # fmt: skip
    path.write_text(json.dumps({"schema": "pipeplan.cluster/1", "levels": [level]}))
    (got,) = load_cluster(str(path)).levels
    assert got == Level(2, 1.5e9, 2e-4, 2.4e9, 8e-4)
    assert got.link.sync_bandwidth == 2.4e9 and got.link.sync_latency == pytest.approx(8e-4)
