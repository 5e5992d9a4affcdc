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
    assert load_profile(tmp_path / "c.json").extra["calibrated"]["runs"][0]["plan_stages"] == 2
    again = ("-o", str(tmp_path / "again"), "--json")
    code, out = _invoke("partition", "--profile", str(tmp_path / "c.json"), *fixed, *again)
    assert code == 0, out
    assert [s["compute_s"] for s in json.loads(out)["stages"]] == pytest.approx([0.117, 0.054])
    assert load_plan(tmp_path / "again" / "toy" / "gpus=2" / "plan.json").profile == str(tmp_path / "c.json")
    # with a traced run correcting a cluster file, the next command plans for that file (its devices)
    pairs = [((f"F{u}", "compute", 0, 5e3 * u), (f"recv F{u}", "comm", 1, 5e3 * u + 500)) for u in range(6)]
    spans = [
        {"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": rank, "ts": start, "dur": 1000.0}
        for pair in pairs
        for name, cat, rank, start in pair
    ]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": spans}))
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        json.dumps({"schema": "pipeplan.cluster/1", "levels": [{"devices": 2, "bandwidth": 1e9}]})
    )
    trace = ("--trace", str(tmp_path / "trace.json"), "--cluster", str(cluster))
    code, out = _invoke("calibrate", str(package), "-o", str(tmp_path / "c.json"), *trace)
    assert code == 0, out
    assert f"next: pipeplan partition --profile {tmp_path / 'c.json'} --cluster {cluster}\n" in out
    code, out = _invoke("partition", "--profile", str(tmp_path / "c.json"), "--cluster", str(cluster), *again)
    assert code == 0, out


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


def _package_with_run(
    tmp_path: Path, graph: Path, name: str, cut: str, seconds: tuple[float, float], *more: str
) -> Path:
    args = (
        *more,
        "--gpus",
        "2",
        "--cuts",
        cut,
        "--replicas",
        "1,1",
        "--batch-size",
        "8",
        "-o",
        str(tmp_path / name),
    )
    assert _invoke("partition", "--profile", str(graph), *args)[0] == 0
    package = next((tmp_path / name).glob("*/gpus=2"))
    (package / "run").mkdir()
    stages = [{"stage": k, "compute_s_per_minibatch": s} for k, s in enumerate(seconds)]
    metrics = {"schema": "pipeplan.metrics/1", "batch_size": 8, "stages": stages}
    (package / "run" / "metrics.json").write_text(json.dumps(metrics))
    return package


def test_several_packages_calibrate_together(tmp_path: Path) -> None:
    """Three runs of one profile, one of them 3x slow: each layer takes its runs' median; the slow
    run is named; --metrics with several packages and packages of another profile are refused."""
    costs = [(5, 10, 4000, 1000), (8, 16, 2000, 2000), (3, 6, 1000, 50), (9, 18, 500, 3000)]
    graph = tmp_path / "toy" / "graph.txt"
    graph.parent.mkdir()
    write_graph_txt(make_profile(costs, [(0, 1), (1, 2), (2, 3)]), graph)
    runs = [
        _package_with_run(tmp_path, graph, f"m{i}", "l1", (0.039 * f, 0.036))
        for i, f in enumerate((1, 3, 1.2))
    ]
    target = tmp_path / "c.json"
    result = CliRunner().invoke(main, ["calibrate", *map(str, runs), "-o", str(target)])
    assert result.exit_code == 0, result.output
    assert "median of the 3 runs" in result.output and "runs disagree" in result.stderr
    assert str(runs[1] / "run" / "metrics.json") in result.stderr
    calibrated = load_profile(target)
    assert calibrated.node("l0").forward_ms == pytest.approx(5 * 1.2)
    assert len(calibrated.extra["calibrated"]["runs"]) == 3
    code, out = _invoke("calibrate", *map(str, runs), "--metrics", str(runs[0] / "run" / "metrics.json"))
    assert code == 2 and out.startswith("error:") and "one package" in out
    graph2 = tmp_path / "toy2" / "graph.txt"
    graph2.parent.mkdir()
    write_graph_txt(make_profile(costs, [(0, 1), (1, 2), (2, 3)]), graph2)
    stranger = _package_with_run(tmp_path, graph2, "x", "l1", (0.039, 0.036))
    target.unlink()
    code, out = _invoke("calibrate", str(runs[0]), str(stranger), "-o", str(target))
    assert code == 2 and "one profile" in out and not target.exists()


def test_a_split_backward_run_beside_a_fused_one_sets_the_split_factor(tmp_path: Path) -> None:
    """A pipedream run at the profile's times and a zb1p run of the same stages whose backward took
    1.5x: calibrate says so, and a zb1p plan from the result predicts the zb1p run."""
    costs = [(5, 10, 4000, 1000), (8, 16, 2000, 2000), (3, 6, 1000, 50), (9, 18, 500, 3000)]
    graph = tmp_path / "toy" / "graph.txt"
    graph.parent.mkdir()
    write_graph_txt(make_profile(costs, [(0, 1), (1, 2), (2, 3)]), graph)
    fused = _package_with_run(tmp_path, graph, "f", "l1", (0.039, 0.036))
    zb = ("--schedule", "zb1p", "--microbatches", "2")
    split = _package_with_run(tmp_path, graph, "s", "l1", (0.013 + 0.039, 0.012 + 0.036), *zb)
    target = tmp_path / "c.json"
    result = CliRunner().invoke(main, ["calibrate", str(fused), str(split), "-o", str(target)])
    assert result.exit_code == 0, result.output
    assert "B + W took 1.50x the fused backward (1 run)" in result.output
    fixed = ("--gpus", "2", "--cuts", "l1", "--replicas", "1,1", *zb)
    code, _ = _invoke("partition", "--profile", str(target), *fixed, "-o", str(tmp_path / "again"))
    assert code == 0
    plan = json.loads(next((tmp_path / "again").glob("*/gpus=2/plan.json")).read_text())
    assert [s["compute_s"] for s in plan["stages"]] == pytest.approx([0.052, 0.048])
