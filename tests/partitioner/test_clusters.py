"""Cluster presets and files: what `partition --cluster` plans for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner.clusters import NODES, load_cluster
from partitioner.errors import PipeplanError, PlanError
from partitioner.plan import Cluster, Level


def test_a_preset_times_nodes_is_a_two_level_cluster() -> None:
    assert load_cluster("dgx-h100:8") == Cluster((Level(8, 450e9), Level(8, 50e9)), 80 * 2**30)
    assert load_cluster("dgx-h100") == Cluster((Level(8, 450e9),), 80 * 2**30)  # one node: NVLink only
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
