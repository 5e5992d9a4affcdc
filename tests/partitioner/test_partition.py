"""``pipeplan partition`` as a library call: no click, the same checks, the same package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner.errors import PlanError
from partitioner.partition import PartitionRequest, partition
from tests.data import PIPEDREAM_PROFILES

ALEXNET = str(PIPEDREAM_PROFILES / "alexnet" / "graph.txt")


def test_a_request_writes_its_plan_and_says_what_it_chose(tmp_path: Path) -> None:
    notes: list[str] = []
    done = partition(PartitionRequest(ALEXNET, gpus=2, schedule="1f1b", output=str(tmp_path)), notes.append)
    assert done.out_dir == tmp_path / "alexnet" / "gpus=2"
    written = json.loads((done.out_dir / "plan.json").read_text())
    assert written["schedule"] == "1f1b" and len(written["stages"]) == len(done.plan.stages)
    assert done.choice is None and done.alternatives is None and done.simulation.events
    assert notes == []


def test_rules_are_the_librarys(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="give exactly one of --gpus"):
        partition(PartitionRequest(ALEXNET, output=str(tmp_path)))
    with pytest.raises(PlanError, match="--cuts and --replicas go together"):
        partition(PartitionRequest(ALEXNET, gpus=2, schedule="1f1b", cuts="x", output=str(tmp_path)))
    assert not (tmp_path / "alexnet").exists()


def test_a_layout_fixed_for_every_stage_is_priced_and_written(tmp_path: Path) -> None:
    """--tensor-parallel and --shard (docs/layout-3d.md) on a profile whose layers say they split."""
    from dataclasses import replace

    from partitioner.graph import read_graph_txt, save_profile

    base = read_graph_txt(ALEXNET)
    nodes = tuple(
        replace(n, tp_param_bytes=n.param_bytes, tp_comm_bytes=n.output_bytes, tp_max=4)
        if n.param_bytes
        else n
        for n in base.nodes
    )
    path = save_profile(replace(base, nodes=nodes), tmp_path / "alexnet3d" / "profile.json")
    request = PartitionRequest(str(path), gpus=4, schedule="1f1b", tensor_parallel=2, shard="optimizer",
                               output=str(tmp_path))  # fmt: skip
    done = partition(request)
    written = json.loads((done.out_dir / "plan.json").read_text())
    assert all(s["tensor_parallel"] == 2 and s["shard"] == "optimizer" for s in written["stages"])
    assert sum(len(s["ranks"]) for s in written["stages"]) == 4 and done.simulation.events
    with pytest.raises(PlanError, match="must divide a node's 4 devices"):
        partition(replace(request, tensor_parallel=3))
