"""`pipeplan calibrate`: a run's stage times make the same plan predict what was measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from partitioner.graph import load_profile, write_graph_txt
from partitioner.plan import load_plan
from tests.partitioner.optimizer.conftest import make_profile


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_calibrate_then_partition(tmp_path: Path) -> None:
    costs = [(5, 10, 4000, 1000), (8, 16, 2000, 2000), (3, 6, 1000, 50), (9, 18, 500, 3000)]
    graph = tmp_path / "toy" / "graph.txt"
    graph.parent.mkdir()
    write_graph_txt(make_profile(costs, [(0, 1), (1, 2), (2, 3)]), graph)
    fixed = (
        "--gpus",
        "2",
        "--cuts",
        "l1",
        "--replicas",
        "1,1",
        "--batch-size",
        "8",
        "-o",
        str(tmp_path / "m"),
    )
    assert _invoke("partition", "--profile", str(graph), *fixed)[0] == 0
    package = tmp_path / "m" / "toy" / "gpus=2"
    (package / "run").mkdir()
    stages = [{"stage": 0, "compute_s_per_minibatch": 0.117}, {"stage": 1, "compute_s_per_minibatch": 0.054}]
    metrics = {"schema": "pipeplan.metrics/1", "batch_size": 8, "stages": stages}
    (package / "run" / "metrics.json").write_text(json.dumps(metrics))
    code, out = _invoke("calibrate", "--models-dir", str(tmp_path / "m"), "-o", str(tmp_path / "c.json"))
    assert code == 0, out
    assert "3.00x" in out and "1.50x" in out
    assert f"next: pipeplan partition --profile {tmp_path / 'c.json'} --gpus 2\n" in out  # runs as printed
    assert load_profile(tmp_path / "c.json").extra["calibrated"]["plan_stages"] == 2
    again = ("-o", str(tmp_path / "again"), "--json")
    code, out = _invoke("partition", "--profile", str(tmp_path / "c.json"), *fixed, *again)
    assert code == 0, out
    assert [s["compute_s"] for s in json.loads(out)["stages"]] == pytest.approx([0.117, 0.054])
    assert load_plan(tmp_path / "again" / "toy" / "gpus=2" / "plan.json").profile == str(tmp_path / "c.json")


def test_calibrate_refuses_a_loaded_run_unless_accepted(tmp_path: Path) -> None:
    graph = tmp_path / "toy" / "graph.txt"
    graph.parent.mkdir()
    write_graph_txt(make_profile([(5, 10, 4000, 1000), (8, 16, 2000, 2000)], [(0, 1)]), graph)
    out_dir = str(tmp_path / "m")
    assert _invoke("partition", "--profile", str(graph), "--gpus", "2", "--cuts", "l0", "--replicas", "1,1",
                   "-o", out_dir)[0] == 0  # fmt: skip
    package = tmp_path / "m" / "toy" / "gpus=2"
    (package / "run").mkdir()
    stages = [{"stage": 0, "compute_s_per_minibatch": 0.05}, {"stage": 1, "compute_s_per_minibatch": 0.07}]
    metrics = {"schema": "pipeplan.metrics/1", "batch_size": 8, "stages": stages,
               "machine": {"loadavg_1min": 9.0, "cpus": 2}}  # fmt: skip
    (package / "run" / "metrics.json").write_text(json.dumps(metrics))
    target = str(tmp_path / "c.json")
    code, out = _invoke("calibrate", str(package), "-o", target)
    assert code == 2 and out.startswith("error:") and "--accept-load" in out
    assert not Path(target).exists()  # nothing half-written
    code, out = _invoke("calibrate", str(package), "-o", target, "--accept-load")
    assert code == 0 and "load 9.00 on 2 cores" in out and Path(target).exists()


def test_calibrate_without_a_run_is_one_line_exit_2(tmp_path: Path) -> None:
    code, out = _invoke("calibrate", "--models-dir", str(tmp_path))
    assert code == 2 and out.startswith("error:") and "pipeplan run" in out
