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
