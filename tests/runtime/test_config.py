"""Reading mp_conf.json + plan.json into a JobConfig, and the options' torchrun round trip."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from runtime.errors import RunError
from runtime.job.launch import torchrun_commands
from runtime.packages.job_config import load_job, replica_microbatches
from runtime.settings.run_options import RunOptions, from_argv, to_argv
from tests.runtime.packages import write_package


def test_job_and_rank_views(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "tied", replicas=(3, 1), microbatches=4, batch_size=8)
    job = load_job(pkg)
    assert job.stage_ranks == ((0, 1, 2), (3,))
    assert (job.schedule, job.microbatches, job.batch_size, job.world_size) == ("1f1b", 4, 8, 4)
    assert job.ties == (((0, "fc.weight"), (1, "w")),)
    assert job.predicted_time_s == pytest.approx(0.01)
    rank = job.for_rank(2)
    assert (rank.stage, rank.replica, rank.is_first, rank.is_last) == (0, 2, True, False)
    assert load_job(pkg, schedule="gpipe", microbatches=2, batch_size=4).microbatches == 2


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        (
            {"module_to_stage_map": [0, 1, 1], "stage_to_rank_map": {"0": [0], "1": [2]}},
            "ranks must be 0..N-1",
        ),
        ({"module_to_stage_map": [0, 1], "stage_to_rank_map": {"0": [0], "1": [1]}}, "plus the criterion"),
        ({"module_to_stage_map": [0, 1, 0, 1], "stage_to_rank_map": {"0": [0], "1": [1]}}, "stage order"),
        ({"stage_to_rank_map": {"0": [0]}}, "module_to_stage_map is missing"),
    ],
)
def test_bad_mp_conf_is_one_clear_line(tmp_path: Path, conf: dict, match: str) -> None:
    pkg = write_package(tmp_path / "pkg")
    (pkg / "mp_conf.json").write_text(json.dumps(conf))
    with pytest.raises(RunError, match=match):
        load_job(pkg)


def test_bad_settings(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", batch_size=8)
    with pytest.raises(RunError, match="equal microbatches"):
        load_job(pkg, microbatches=3)
    with pytest.raises(RunError, match="unknown schedule"):
        load_job(pkg, schedule="zigzag")
    with pytest.raises(RunError, match="does not exist"):
        load_job(tmp_path / "missing")


def test_options_survive_the_torchrun_command_line(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", replicas=(1, 1, 1, 1))
    opts = RunOptions.of(str(pkg), steps=7, schedule="gpipe", lr=0.5, shuffle=True, trace="t.json", nnodes=2)
    assert from_argv(to_argv(opts)) == RunOptions.of(
        str(pkg), steps=7, schedule="gpipe", lr=0.5, shuffle=True, trace="t.json"
    )
    data = RunOptions(str(pkg), data="text:a.txt", seq_len=64, tokenizer="tok", data_workers=0)
    data = replace(data, eval_data="imagefolder:b", eval_every=5)
    assert from_argv(to_argv(data)) == data
    lines = torchrun_commands(
        RunOptions(str(pkg), steps=7, nnodes=2, master_addr="10.0.0.1", master_port=29400)
    )
    assert len(lines) == 2
    assert "--node-rank 1 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29400" in lines[1]
    assert lines[0].endswith(f"-m runtime.job.worker {pkg} --steps 7")


def test_planned_microbatches_grow_to_feed_every_replica(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", replicas=(3, 1), microbatches=1, batch_size=12)
    assert load_job(pkg).microbatches == 3
    assert load_job(pkg, microbatches=1).microbatches == 1  # an explicit choice is kept
    assert replica_microbatches(2, ((0, 1, 2), (3,), (4, 5)), 12) == 6
    assert replica_microbatches(1, ((0, 1, 2), (3,)), 8) == 1  # 3 does not divide 8: keep the plan's
    assert replica_microbatches(4, ((0, 1), (2,)), 8) == 4


def test_recompute_and_predicted_memory_per_stage(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(2, 1))
    job = load_job(pkg)  # a plan.json without the fields: nothing recomputes
    assert job.recompute == (False, False) and not job.for_rank(0).recompute
    plan = json.loads((pkg / "plan.json").read_text())
    for stage in plan["stages"]:
        del stage["recompute"]
    plan["stages"][1].update(recompute=True, memory_bytes=1234)
    (pkg / "plan.json").write_text(json.dumps(plan))
    job = load_job(pkg)
    assert [job.for_rank(r).recompute for r in range(3)] == [False, False, True]
    assert job.predicted_memory_bytes == (0, 1234)
    plan["stages"][1]["recompute"] = "yes"
    (pkg / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(RunError, match="recompute"):
        load_job(pkg)
