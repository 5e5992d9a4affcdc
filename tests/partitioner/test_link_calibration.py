"""Link calibration from a traced run: which messages are timed, the latency they give, the refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cli import main
from cli_render.calibrate import print_links
from partitioner.calibration.link_latency import (
    action_gaps,
    calibrate_with_links,
    measure_links,
    measure_runs,
    save_links,
    timed_allreduces,
    waited_messages,
)
from partitioner.errors import PipeplanError
from partitioner.graph import write_graph_txt
from partitioner.hardware.clusters import load_cluster
from tests.partitioner.optimizer.conftest import make_profile

MB = 1e6  # bytes a message carries in the plans below (a 4,000,000-byte cut over 4 microbatches)


def _span(rank: int, name: str, start_us: float, end_us: float, cat: str = "compute") -> dict[str, Any]:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": rank,
        "tid": rank,
        "ts": start_us,
        "dur": end_us - start_us,
    }


def _trace(wires_us: list[float], busy: int = 0) -> list[dict[str, Any]]:
    """Two stages: stage 1 waits for each forward (its receive starts before the send), then `busy`
    messages whose receiver was still computing; and one backward the other way, waited for."""
    events, t = [], 0.0
    for u, wire in enumerate(wires_us):
        events += [_span(0, f"F{u}", t, t + 1000), _span(1, f"recv F{u}", t + 500, t + 1000 + wire, "comm")]
        t += 10_000
    for u in range(len(wires_us), len(wires_us) + busy):
        events += [_span(0, f"F{u}", t, t + 1000), _span(1, f"recv F{u}", t + 3000, t + 3010, "comm")]
        t += 10_000
    events += [_span(1, "B0", t, t + 1000), _span(0, "recv B0", t + 100, t + 1000 + wires_us[0], "comm")]
    return events


def test_only_messages_whose_receiver_waited_are_timed() -> None:
    got = waited_messages(_trace([200.0, 300.0, 250.0], busy=2), [(0.0, MB), (MB, 0.0)])
    assert got.seconds == pytest.approx([200e-6, 300e-6, 250e-6, 200e-6])
    assert got.nbytes == (MB, MB, MB, MB)  # forwards into stage 1, the backward into stage 0
    assert got.skipped == 2  # arrived while stage 1 computed: their wire time is unknown


def _package(tmp_path: Path, schedule: str = "1f1b", gpus: int = 2) -> Path:
    costs = [(5, 10, 4_000_000, 1000), (8, 16, 2000, 2000), (5, 10, 2000, 1000), (8, 16, 2000, 2000)]
    graph = tmp_path / "toy" / "graph.txt"
    graph.parent.mkdir(exist_ok=True)
    write_graph_txt(make_profile(costs, [(0, 1), (1, 2), (2, 3)]), graph)
    out = tmp_path / f"m-{schedule}-{gpus}"
    args = ["partition", "--profile", str(graph), "--gpus", str(gpus), "--schedule", schedule,
            "--microbatches", "4", "-o", str(out)]  # fmt: skip
    if schedule != "interleaved":  # (interleaved: the optimizer's 4 stages on 2 ranks)
        args += ["--cuts", "l0", "--replicas", "1,1" if gpus == 2 else "2,2"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    return next(out.rglob("plan.json")).parent


def _cluster(tmp_path: Path, devices: int = 2) -> Path:
    path = tmp_path / "cluster.json"
    level = {"devices": devices, "bandwidth": 1e10, "latency": 1e-3}
    path.write_text(
        json.dumps({"schema": "pipeplan.cluster/1", "levels": [level], "probe": {"cores": "busy"}})
    )
    return path


def test_the_latency_is_the_median_wire_time_less_the_bytes_on_the_wire(tmp_path: Path) -> None:
    folder, cluster, trace = _package(tmp_path), _cluster(tmp_path), tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": _trace([200.0, 300.0, 250.0, 400.0, 220.0, 260.0])}))
    done = measure_links(folder, trace, cluster)
    assert json.loads(cluster.read_text())["levels"][0]["latency"] == 1e-3  # nothing written yet
    # every message carries 1 MB at 10 GB/s (100 us); the 7 wire times' median is 250 us
    assert done.latency_s == pytest.approx(150e-6) and done.latency_before_s == 1e-3
    save_links(done)
    assert load_cluster(str(cluster)).levels[0].latency == pytest.approx(150e-6)
    doc = json.loads(cluster.read_text())
    assert doc["calibrated"]["messages_timed"] == 7 and doc["calibrated"]["latency_before"] == 1e-3
    assert doc["probe"] == {"cores": "busy"} and doc["levels"][0]["bandwidth"] == 1e10  # the rest is kept


def test_what_a_trace_cannot_time_is_refused(tmp_path: Path) -> None:
    cluster, trace = _cluster(tmp_path), tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": _trace([200.0, 300.0], busy=5)}))
    with pytest.raises(PipeplanError, match=r"3 messages whose receiver was waiting .* at least 5"):
        measure_links(_package(tmp_path), trace, cluster)
    with pytest.raises(PipeplanError, match="more than one host's 2: hosts' clocks differ"):
        measure_links(_package(tmp_path, gpus=4), trace, cluster)
    with pytest.raises(PipeplanError, match="stages per rank"):
        measure_links(_package(tmp_path, "interleaved"), trace, cluster)
    with pytest.raises(PipeplanError, match="--trace and --cluster go together"):
        calibrate_with_links([tmp_path], None, None, False, [str(trace)], None)
    result = CliRunner().invoke(main, ["calibrate", str(tmp_path), "--cluster", str(cluster)])
    assert result.exit_code == 2 and result.stderr.startswith("error:") and "go together" in result.stderr


def _allreduces(durations_us: list[tuple[float, float]], stage: int = 0) -> list[dict[str, Any]]:
    """Each step's all-reduce span on ranks 0 and 1, both replicas of ``stage``."""
    events, t = [], 0.0
    for a, b in durations_us:
        for rank, dur in ((0, a), (1, b)):
            events.append({**_span(rank, "all-reduce", t, t + dur, "comm"), "tid": stage})
        t += 10_000
    return events


def test_each_steps_allreduce_is_its_replicas_mean() -> None:
    """A replica's span holds its wait for the slower one: the mean is what the step pays beyond the
    replicas' mean compute."""
    got = timed_allreduces(_allreduces([(900.0, 500.0), (400.0, 700.0)]), [(2, 4e6)])
    assert got.seconds == pytest.approx([700e-6, 550e-6]) and got.nbytes == (4e6, 4e6)
    assert timed_allreduces(_allreduces([(900.0, 500.0)]), [(1, 4e6)]).seconds == ()  # not replicated


def _data_parallel(tmp_path: Path) -> Path:
    """A package of one stage (3000 parameter bytes) on 2 replicas."""
    costs = [(5, 10, 2000, 1000), (8, 16, 2000, 2000)]
    graph = tmp_path / "dp" / "graph.txt"
    graph.parent.mkdir()
    write_graph_txt(make_profile(costs, [(0, 1)]), graph)
    args = ["partition", "--profile", str(graph), "--gpus", "2", "--cuts", "", "--replicas", "2",
            "--schedule", "1f1b", "--microbatches", "2", "-o", str(tmp_path / "m")]  # fmt: skip
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return next((tmp_path / "m").rglob("plan.json")).parent


def test_a_data_parallel_run_corrects_the_allreduce_latency(tmp_path: Path) -> None:
    """One stage of 3000 parameter bytes on 2 replicas: no messages, 6 steps whose replicas' spans
    average 500 + 100k us (1000 + 200k and 0): the latency per ring step is their median, 750 us, less
    the volume 4(r-1)P/(rB), over the ring's 2(r-1) = 2 steps; the message latency is kept."""
    folder = _data_parallel(tmp_path)
    cluster, trace = _cluster(tmp_path), tmp_path / "trace.json"
    steps = [(1000.0 + 200 * k, 0.0) for k in range(6)]
    trace.write_text(json.dumps({"traceEvents": _allreduces(steps)}))
    done = measure_links(folder, trace, cluster)
    assert done.latency_s is None and done.allreduce_latency_before_s == 1e-3
    volume = 4.0 * 3000 / (2 * 1e10)  # 4(r-1)P/(rB): the profile's 3000 parameter bytes
    assert done.allreduce_latency_s == pytest.approx((750e-6 - volume) / 2)
    save_links(done)
    (level,) = load_cluster(str(cluster)).levels
    assert level.latency == 1e-3 and level.allreduce_latency == pytest.approx(done.allreduce_latency_s)
    assert json.loads(cluster.read_text())["calibrated"]["allreduces_timed"] == 6


def test_a_pipeline_and_a_data_parallel_run_correct_both_latencies(tmp_path: Path) -> None:
    """Neither run alone times both: the pipeline's 7 messages set the latency, the data-parallel
    run's 6 all-reduces the all-reduce latency; each with as few as one of them is pooled, and
    more traces than packages is refused before anything is written."""
    pipeline, data_parallel, cluster = _package(tmp_path), _data_parallel(tmp_path), _cluster(tmp_path)
    messages, allreduces = tmp_path / "pipeline.json", tmp_path / "dp.json"
    messages.write_text(json.dumps({"traceEvents": _trace([200.0, 300.0, 250.0, 400.0, 220.0, 260.0])}))
    allreduces.write_text(
        json.dumps({"traceEvents": _allreduces([(1000.0 + 200 * k, 0.0) for k in range(6)])})
    )
    done = measure_runs([(pipeline, messages), (data_parallel, allreduces)], cluster)
    assert done.latency_s == pytest.approx(150e-6) and len(done.messages.seconds) == 7
    assert done.allreduce_latency_s == pytest.approx((750e-6 - 4.0 * 3000 / 2e10) / 2)
    assert done.trace == f"{messages}, {allreduces}"
    short, few = tmp_path / "short.json", tmp_path / "few.json"
    short.write_text(json.dumps({"traceEvents": _trace([200.0, 300.0, 250.0])}))
    few.write_text(json.dumps({"traceEvents": _allreduces([(900.0, 100.0)] * 3)}))
    with pytest.raises(PipeplanError, match=r"few\.json have 4 messages .* and 3 gradient all-reduces"):
        measure_runs([(pipeline, short), (data_parallel, few)], cluster)
    before = cluster.read_text()
    args = ["calibrate", str(pipeline), "--trace", str(messages), "--trace", str(allreduces),
            "--cluster", str(cluster)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "2 traces for 1 package" in result.stderr
    assert cluster.read_text() == before


def test_the_time_per_action_is_the_mean_idle_time_after_an_action(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 forwards 10 microbatches, 1000 us each with 400 us between them, rank 1 waits for each
    (200 us on the wire): the runtime's time per action is the 400 us after each forward (the first
    fifth of the trace skipped), written to the cluster file beside the latency and read back."""
    events = []
    for u in range(10):
        t = 1400.0 * u
        events += [_span(0, f"F{u}", t, t + 1000), _span(1, f"recv F{u}", t + 500, t + 1200, "comm")]
    assert action_gaps(events) == pytest.approx([400e-6] * 7)  # F2..F8: F0 and F1 start the trace
    folder, cluster, trace = _package(tmp_path), _cluster(tmp_path), tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    done = measure_links(folder, trace, cluster)
    assert done.action_s == pytest.approx(400e-6) and done.action_before_s == 0.0
    save_links(done)
    assert load_cluster(str(cluster)).action_s == pytest.approx(400e-6)
    doc = json.loads(cluster.read_text())
    assert doc["calibrated"]["actions_timed"] == 7 and doc["calibrated"]["action_before"] == 0.0
    assert doc["calibrated"]["allreduce_s_quartiles"] == []  # none timed: strict JSON, no NaN
    print_links(done)
    said = " ".join(capsys.readouterr().out.split())
    assert "the runtime's time per action 0 us -> 400 us (mean idle time after 7 actions)" in said, said
