"""plan.json round trip and PipeDream's mp_conf.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner.errors import PlanError
from partitioner.optimizer import solve
from partitioner.plan import Cluster, Level, load_plan, mp_conf, plan_from_json, plan_to_json, save_plan
from tests.partitioner.optimizer.conftest import make_profile

PROFILE = make_profile(
    [(5, 10, 4000, 1000), (8, 16, 2000, 90000), (3, 6, 1000, 50)], [(0, 1), (1, 2), (0, 2)]
)


def test_plan_json_round_trip(tmp_path: Path) -> None:
    plan = solve(PROFILE, Cluster((Level(2, 4e9), Level(2, 1e9)), memory_bytes=2**30), schedule="1f1b",
                 microbatches=3, optimizer="adam")  # fmt: skip
    path = save_plan(plan, tmp_path / "plan.json")
    assert load_plan(path) == plan
    doc = json.loads(path.read_text())
    assert doc["schema"] == "pipeplan.plan/1"
    for key in ("gpus", "cluster", "schedule", "microbatches", "stages", "predicted", "solver"):
        assert key in doc
    assert plan_from_json(plan_to_json(plan)) == plan


def test_a_links_allreduce_figures_round_trip_and_price_the_sync(tmp_path: Path) -> None:
    """A level's own all-reduce figures reach the plan's link, are saved only when given, and the
    all-reduce is priced with them: 2 replicas of 1 MB at 2 GB/s and 1 ms a step: 1 + 2 ms."""
    from partitioner.optimizer.pricing.stage import allreduce_time

    level = Level(2, 1e9, 1e-4, 2e9, 1e-3)
    assert allreduce_time(1e6, 2, level.link) == pytest.approx(3e-3)
    assert allreduce_time(1e6, 2, Level(2, 1e9, 1e-4).link) == pytest.approx(2e-3 + 2e-4)
    two = Cluster((level, Level(2, 4e9, 5e-5, None, 3e-3)))
    assert (two.slowest.sync_bandwidth, two.slowest.sync_latency) == (2e9, 3e-3)
    plan = solve(PROFILE, Cluster((level,)), schedule="1f1b", microbatches=2)
    path = save_plan(plan, tmp_path / "plan.json")
    assert load_plan(path) == plan
    (saved,) = json.loads(path.read_text())["cluster"]["levels"]
    assert saved["allreduce_bandwidth"] == 2e9 and saved["allreduce_latency"] == 1e-3
    plain = plan_to_json(solve(PROFILE, Cluster.flat(2)))["cluster"]["levels"][0]
    assert "allreduce_bandwidth" not in plain and "allreduce_latency" not in plain
    with pytest.raises(PlanError, match="all-reduce bandwidth"):
        Cluster((Level(2, 1e9, 0.0, 0.0),))


def test_mp_conf_is_pipedreams_format() -> None:
    plan = solve(PROFILE, Cluster.flat(4))
    conf = mp_conf(plan.stages)
    assert conf["module_to_stage_map"] == [*range(len(plan.stages)), len(plan.stages) - 1]
    ranks = [r for s in plan.stages for r in s.ranks]
    assert sorted(ranks) == list(range(plan.gpus))
    assert conf["stage_to_rank_map"]["0"] == list(plan.stages[0].ranks)


def test_corrupt_plan_is_a_plan_error(tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text('{"schema": "pipeplan.plan/1", "gpus": 2}')
    with pytest.raises(PlanError):
        load_plan(bad)


def test_recompute_round_trips_and_old_plans_read_as_none(tmp_path: Path) -> None:
    plan = solve(PROFILE, Cluster.flat(2), schedule="gpipe", microbatches=2, recompute="all")
    assert all(s.recompute for s in plan.stages)
    doc = plan_to_json(plan)
    assert plan_from_json(doc) == plan
    for stage in doc["stages"]:
        del stage["recompute"]  # a plan.json written before the field existed
    assert not any(s.recompute for s in plan_from_json(doc).stages)
    doc["stages"][0]["recompute"] = "false"
    with pytest.raises(PlanError, match="recompute"):
        plan_from_json(doc)


def test_a_3d_stage_round_trips_and_a_2d_one_is_written_as_before() -> None:
    """docs/layout-3d.md: tensor_parallel and shard are written only where they are not the default."""
    from partitioner.plan import Stage, _stage_from_json

    flat = Stage(0, ("a",), 2, (0, 1))
    assert "tensor_parallel" not in _plan_doc_stage(flat) and "shard" not in _plan_doc_stage(flat)
    cube = Stage(0, ("a",), 2, (0, 1, 2, 3), tensor_parallel=2, shard="optimizer")
    doc = _plan_doc_stage(cube)
    assert (doc["tensor_parallel"], doc["shard"]) == (2, "optimizer")
    assert _stage_from_json(doc) == cube and cube.devices == 4


def test_a_3d_stage_that_does_not_add_up_is_refused() -> None:
    from partitioner.plan import Stage

    with pytest.raises(PlanError, match="3 ranks for 2 copies of 2 devices"):
        Stage(0, ("a",), 2, (0, 1, 2), tensor_parallel=2)
    with pytest.raises(PlanError, match="at least 2 data-parallel copies"):
        Stage(0, ("a",), 1, (0, 1), tensor_parallel=2, shard="full")
    with pytest.raises(PlanError, match="shard must be one of"):
        Stage(0, ("a",), 2, (0, 1), shard="zero9")


def _plan_doc_stage(stage: object) -> dict[str, object]:
    from partitioner.plan import Cluster, Plan, Prediction, SolverInfo, plan_to_json

    plan = Plan(4, Cluster.flat(4), "1f1b", 2, (stage,), Prediction(1.0), SolverInfo("test", 0.0, True))  # type: ignore[arg-type]
    return plan_to_json(plan)["stages"][0]  # type: ignore[no-any-return]
