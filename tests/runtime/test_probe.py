"""`pipeplan probe`: two local gloo ranks measured, a cluster file `partition --cluster` reads, and a
cluster file whose latency is large changes the plan."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

import partitioner.calibration.action_probe
import runtime.job.link_probe
from cli import main
from partitioner.calibration.action_probe import ActionProbe
from partitioner.graph import write_graph_txt
from partitioner.hardware.clusters import load_cluster
from partitioner.optimizer.pricing.stage import allreduce_time
from partitioner.plan import Link
from runtime.errors import RunError
from runtime.job.link_probe import LinkFigure, ProbeOptions, ProbeResult, _cores_busy, fit_allreduce
from tests.partitioner.optimizer.conftest import make_profile


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.slow
def test_probe_two_local_ranks_writes_a_cluster_file(tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    code, out, err = _run("probe", "--gpus", "2", "--device", "cpu", "--rounds", "2", "--messages", "2",
                          "-o", str(path))  # fmt: skip
    assert code == 0, err
    cluster = load_cluster(str(path))
    (level,) = cluster.levels
    assert level.devices == 2 and level.latency > 0 and level.bandwidth > 0
    doc = json.loads(path.read_text())
    link = doc["probe"]["links"][0]
    assert len(link["latency_rounds_s"]) == 2 and link["latency_spread"] >= 0  # how steady it was
    assert [row["bytes"] for row in doc["probe"]["allreduce"]] == [4096, 1 << 20, 16 << 20]
    # the all-reduces, timed with the ranks idle, price the cluster's all-reduce as a ring
    assert doc["probe"]["allreduce_cores"] == "idle" and "all-reduces over every rank" in doc["sources"]
    rows = [(r["bytes"], r["seconds"], r["spread"]) for r in doc["probe"]["allreduce"]]
    fitted = fit_allreduce(rows, 2)  # 16 MiB takes longer than 1 MiB: a fit
    assert fitted is not None and (level.allreduce_bandwidth, level.allreduce_latency) == fitted
    assert "priced as a ring" in " ".join(out.split())
    assert "latency" in out and "all-reduce 16 MiB" in out and "spread" in out
    # CPU ranks are measured computing, as a run's are, and the file says so
    assert doc["probe"]["cores"] == "busy" and doc["probe"]["threads"] >= 1
    assert 0 < doc["probe"]["core_share"] <= 1
    assert "computing on" in doc["sources"] and "computing on" in " ".join(out.split())
    # the runtime's time per action, from a short traced run of the runtime's own loop
    assert cluster.action_s == doc["action_overhead"] == doc["probe"]["actions"]["action_s"] > 0
    assert doc["probe"]["actions"]["actions_timed"] >= 5 and "time per action" in " ".join(out.split())
    assert doc["probe"]["actions"]["ranks"] == 2  # one stage a rank: its actions send and receive


def test_the_time_per_action_lands_in_the_cluster_file_partition_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime.job.link_probe, "probe", lambda o: _fake_result(o))
    found = ActionProbe(4e-4, 120, 3e-4, ("pipeplan run PKG --trace T",), 2)
    hosted = {"interleaved": 9e-4, "zbv": 6e-4}  # a rank of two stages: its own figure per schedule

    def probe_actions(ranks: int, device: str, schedule: str = "1f1b") -> ActionProbe:
        return found if schedule == "1f1b" else replace(found, action_s=hosted[schedule])

    monkeypatch.setattr(partitioner.calibration.action_probe, "probe_actions", probe_actions)
    path = tmp_path / "cluster.json"
    code, out, err = _run("probe", "--device", "cpu", "-o", str(path))
    assert code == 0, err
    cluster = load_cluster(str(path))
    assert cluster.action_s == pytest.approx(4e-4)
    assert dict(cluster.schedule_action_s) == hosted and cluster.action_for("zbv") == 6e-4
    assert cluster.action_for("1f1b") == cluster.action_for("zb1p") == 4e-4
    assert "under interleaved, two stages a rank: 0.900 ms" in " ".join(out.split())
    doc = json.loads(path.read_text())
    assert doc["probe"]["actions"] == {"action_s": 4e-4, "median_s": 3e-4, "actions_timed": 120, "ranks": 2,
                                       "commands": ["pipeplan run PKG --trace T"]}  # fmt: skip
    assert "time per action 0.400 ms" in " ".join(out.split())


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_fitted_all_reduce_has_the_largest_sizes_slope_through_the_smallest(ranks: int) -> None:
    """The cost model's ring (``allreduce_time``) at the fitted figures takes the measured extra time
    from the middle size to the largest, and gives back the smallest's time (its latency)."""
    rows = [(4096, 6e-4, 0.1), (1 << 20, 3.0e-3, 0.2), (16 << 20, 17.5e-3, 0.1)]
    bandwidth, latency = fit_allreduce(rows, ranks) or (0.0, 0.0)
    link = Link(1e9, 0.0, bandwidth, latency)
    priced = [allreduce_time(float(nbytes), ranks, link) for nbytes, _, _ in rows]
    assert priced[2] - priced[1] == pytest.approx(17.5e-3 - 3.0e-3, rel=1e-9)
    assert priced[0] == pytest.approx(6e-4, rel=1e-9) and latency > 0
    # no extra time for the extra bytes, one size, one rank: nothing to fit
    assert fit_allreduce([(1 << 20, 3e-3, 0.0), (16 << 20, 3e-3, 0.0)], ranks) is None
    assert fit_allreduce(rows[:1], ranks) is None and fit_allreduce(rows, 1) is None
    # a smallest all-reduce quicker than its bytes: latency 0, not negative
    assert fit_allreduce([(4096, 1e-9, 0.0), *rows[1:]], ranks)[1] == 0.0  # type: ignore[index]


def test_busy_cores_compute_beside_the_block_and_stop_after_it() -> None:
    before = threading.active_count()
    with _cores_busy(1, busy=True) as share:
        time.sleep(0.2)
        assert threading.active_count() == before + 1
        got = share()
    assert got is not None and 0 < got <= 1
    assert threading.active_count() == before  # the computing thread is joined
    with _cores_busy(1, busy=False) as share:
        assert share() is None and threading.active_count() == before


def test_idle_is_an_option_on_cpu_and_cuda_is_never_loaded() -> None:
    assert ProbeOptions(gpus=2).busy
    assert not ProbeOptions(gpus=2, idle=True).busy
    assert not ProbeOptions(gpus=2, device="cuda").busy


def _fake_result(options: ProbeOptions) -> ProbeResult:
    link = LinkFigure(0, 2, (0, 1), 1e-4, 1e9, (1e-4, 1e-4), (1e9, 1e9))
    busy = options.busy
    return ProbeResult(
        (link,), ((4096, 2e-4, 0.0),), 2, "gloo", (0.5, 0.5), None,
        cores="busy" if busy else "idle", threads=1, core_share=0.9 if busy else None,
    )  # fmt: skip


def test_the_cluster_file_records_how_the_cores_were_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[ProbeOptions] = []
    monkeypatch.setattr(runtime.job.link_probe, "probe", lambda o: seen.append(o) or _fake_result(o))
    for flag, cores in (("--idle", "idle"), ("", "busy")):
        path = tmp_path / f"{cores}.json"
        code, out, err = _run(
            "probe", "--device", "cpu", "--no-actions", *([flag] if flag else []), "-o", str(path)
        )
        assert code == 0, err
        doc = json.loads(path.read_text())
        assert "action_overhead" not in doc
        assert doc["probe"]["cores"] == cores and load_cluster(str(path)).levels[0].latency == 1e-4
        said = "ranks idle" if cores == "idle" else "computing on 1 thread(s)"
        assert said in doc["sources"] and said in " ".join(out.split())
    assert [o.idle for o in seen] == [True, False]


def test_probe_refuses_what_it_cannot_measure() -> None:
    with pytest.raises(RunError, match="at least 2 ranks"):
        ProbeOptions(gpus=1)
    with pytest.raises(RunError, match="--device must be cpu or cuda"):
        ProbeOptions(gpus=2, device="tpu")
    code, _, err = _run("probe", "--gpus", "1", "--device", "cpu")
    assert code == 2 and err.startswith("error:") and "at least 2 ranks" in err


def test_a_slow_link_in_a_cluster_file_changes_the_plan(tmp_path: Path) -> None:
    """The same file with 20 ms per message instead of none: pipedream's replicated stages would
    all-reduce in rings of 20 ms steps, so the plan replicates less (or cuts elsewhere)."""
    costs = [(5, 10, 4000, 1000), (8, 16, 2000, 2000), (3, 6, 1000, 500), (9, 18, 500, 3000)]
    graph = tmp_path / "toy" / "graph.txt"
    graph.parent.mkdir()
    write_graph_txt(make_profile(costs, [(0, 1), (1, 2), (2, 3)]), graph)
    plans = {}
    for latency in ("0", "20ms"):
        path = tmp_path / f"cluster-{latency}.json"
        level = {"devices": 4, "bandwidth": "10GB/s", "latency": latency}
        path.write_text(json.dumps({"schema": "pipeplan.cluster/1", "levels": [level]}))
        code, out, err = _run("partition", "--profile", str(graph), "--cluster", str(path), "--json",
                              "-o", str(tmp_path / "m"))  # fmt: skip
        assert code == 0, err
        plans[latency] = json.loads(out)
    shape = {k: [(s["nodes"], s["replicas"]) for s in p["stages"]] for k, p in plans.items()}
    assert shape["0"] != shape["20ms"]
    assert (
        plans["20ms"]["predicted"]["time_per_minibatch_s"] > plans["0"]["predicted"]["time_per_minibatch_s"]
    )
