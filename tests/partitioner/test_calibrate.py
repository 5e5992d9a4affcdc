"""calibrate: measured stage times scale the profile so the same plan predicts what was measured."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from partitioner.calibration.stage_times import (
    Measured,
    RunTimes,
    calibrate,
    calibrate_runs,
    check_run,
    device_seconds,
    disagreement,
    load_run_times,
    load_verdict,
    stage_factors,
)
from partitioner.errors import PipeplanError
from partitioner.graph import Profile
from partitioner.optimizer import evaluate
from partitioner.plan import Cluster, Plan
from tests.partitioner.optimizer.conftest import make_profile

COSTS = [(5, 10, 4000, 1000), (8, 16, 2000, 2000), (3, 6, 1000, 50), (9, 18, 500, 3000)]
CHAIN = [(0, 1), (1, 2), (2, 3)]


def _plan() -> tuple[Profile, Plan]:
    profile = make_profile(COSTS, CHAIN)
    return profile, evaluate(profile, Cluster.flat(2), ["l1"], [1, 1], "pipedream", 1, "sgd", True)


def test_same_plan_predicts_the_measured_stage_times() -> None:
    profile, plan = _plan()
    measured = {0: 0.117, 1: 0.054}  # profiled: 39 ms and 36 ms
    assert stage_factors(profile, plan, measured) == pytest.approx({0: 3.0, 1: 1.5})
    fixed = calibrate(profile, plan, measured, batch_size=profile.batch_size)
    again = evaluate(fixed, Cluster.flat(2), ["l1"], [1, 1], "pipedream", 1, "sgd", True)
    assert [s.compute_s for s in again.stages] == pytest.approx([0.117, 0.054])
    assert fixed.node("l0").forward_ms == pytest.approx(15.0)  # the per-layer shape is kept
    assert fixed.extra["calibrated"]["runs"][0]["factors"] == pytest.approx({0: 3.0, 1: 1.5})


def test_a_calibrated_profile_keeps_pricing_other_microbatch_counts() -> None:
    chain = make_profile(COSTS, CHAIN, batch_size=8)
    layers = {n.id for n in chain.layers}
    nodes = tuple(
        replace(n, forward_fixed_ms=1.0, backward_fixed_ms=2.0) if n.id in layers else n for n in chain.nodes
    )
    profile = replace(chain, nodes=nodes)
    plan = evaluate(profile, Cluster.flat(2), ["l1"], [1, 1], "1f1b", 4)
    measured = {s.index: 2.0 * s.compute_s for s in plan.stages}  # the run took twice the plan's compute
    fixed = calibrate(profile, plan, measured, batch_size=8)
    for m in (1, 4, 8):
        before = evaluate(profile, Cluster.flat(2), ["l1"], [1, 1], "1f1b", m)
        after = evaluate(fixed, Cluster.flat(2), ["l1"], [1, 1], "1f1b", m)
        assert [s.compute_s for s in after.stages] == pytest.approx(
            [2.0 * s.compute_s for s in before.stages]
        )
    assert fixed.node("l0").forward_fixed_ms == pytest.approx(2.0)


def test_several_runs_give_each_layer_the_median_of_the_runs_that_measured_it() -> None:
    """Three runs of the plan cut after l1 (stage 0 at 1x, 3x, 1.2x; stage 1 at 1x, 1x, 1.1x) and one
    of a plan cut after l0 (l0 at 1x, l1..l3 at 2x): every layer takes the median of its four runs
    (l0: 1, 3, 1.2, 1 -> 1.1; l1: 1, 3, 1.2, 2 -> 1.6; l2, l3: 1, 1, 1.1, 2 -> 1.05); the one slow
    run (3x) moves l0 by a tenth, not to its mean of 1.55."""
    profile, plan = _plan()  # stage 0 = l0, l1 (39 ms); stage 1 = l2, l3 (36 ms)
    other = evaluate(profile, Cluster.flat(2), ["l0"], [1, 1], "pipedream", 1, "sgd", True)
    runs = [
        Measured(plan, {0: 0.039, 1: 0.036}, None, "a"),
        Measured(plan, {0: 0.117, 1: 0.036}, None, "b"),
        Measured(plan, {0: 0.039 * 1.2, 1: 0.036 * 1.1}, None, "c"),
        Measured(other, {0: other.stages[0].compute_s, 1: 2 * other.stages[1].compute_s}, None, "d"),
    ]
    fixed = calibrate_runs(profile, runs)
    scale = {n.id: fixed.node(n.id).compute_ms / n.compute_ms for n in profile.layers}
    assert scale == pytest.approx({"l0": 1.1, "l1": 1.6, "l2": 1.05, "l3": 1.05})
    assert [r["metrics"] for r in fixed.extra["calibrated"]["runs"]] == ["a", "b", "c", "d"]
    assert calibrate_runs(profile, runs[:1]) == calibrate(profile, plan, {0: 0.039, 1: 0.036}, None, "a")


def test_a_rank_running_several_stages_calibrates_them_by_their_sum() -> None:
    """An interleaved run times a rank's stages together (stages 0 and 2 on rank 0, 1 and 3 on rank
    1): each of them takes the factor of the sum, and the same plan re-priced predicts what each rank
    measured; a stage no rank's time covers is still refused."""
    profile, _ = _plan()
    cluster = Cluster.flat(2)
    plan = evaluate(profile, cluster, ["l0", "l1", "l2"], [1] * 4, "interleaved", 2, virtual_stages=2)
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (0,), (1,)]
    hosted = {0: (0, 2), 1: (1, 3)}
    want = {0: 2.0 * (plan.stages[0].compute_s + plan.stages[2].compute_s), 1: plan.stages[1].compute_s}
    want[1] += plan.stages[3].compute_s
    fixed = calibrate_runs(profile, [Measured(plan, want, None, "il", hosted)])
    scale = {n.id: fixed.node(n.id).compute_ms / n.compute_ms for n in profile.layers}
    assert scale == pytest.approx({"l0": 2.0, "l1": 1.0, "l2": 2.0, "l3": 1.0})
    again = evaluate(fixed, cluster, ["l0", "l1", "l2"], [1] * 4, "interleaved", 2, virtual_stages=2)
    got = {r: sum(s.compute_s for s in again.stages if s.index in hosted[r]) for r in hosted}
    assert got == pytest.approx(want)
    with pytest.raises(PipeplanError, match="no time for stage 2"):
        calibrate_runs(profile, [Measured(plan, want, None, "il", {1: (1, 3)})])


def test_split_backward_runs_set_the_split_factor_and_fused_runs_the_layers() -> None:
    """A 1f1b run measured the plan's compute (every layer 1x); a zbv run of the same layers measured
    forward + 1.5 x backward (the runtime's B + W on small layers): the layers keep 1x from the fused
    run, the profile records g = 1.5, and every schedule re-priced predicts what its run measured.
    Calibrating the calibrated profile again changes nothing; a zbv run alone scales the layers
    against the g the profile has."""
    profile = make_profile(COSTS, CHAIN)
    cluster, cuts = Cluster.flat(2), ["l0", "l1", "l2"]
    fused = evaluate(profile, cluster, ["l1"], [1, 1], "1f1b", 4)
    split = evaluate(profile, cluster, cuts, [1] * 4, "zbv", 4)
    hosted = {0: (0, 3), 1: (1, 2)}
    f_b = {s.index: sum((profile.node(n).forward_ms, 1.5 * profile.node(n).backward_ms)[i]
                        for n in s.nodes for i in (0, 1)) / 1e3 for s in split.stages}  # fmt: skip
    want = {r: f_b[a] + f_b[b] for r, (a, b) in hosted.items()}
    runs = [
        Measured(fused, {s.index: s.compute_s for s in fused.stages}, None, "1f1b"),
        Measured(split, want, None, "zbv", hosted),
    ]
    fixed = calibrate_runs(profile, runs)
    assert {n.id: fixed.node(n.id).compute_ms / n.compute_ms for n in profile.layers} == pytest.approx(
        {"l0": 1.0, "l1": 1.0, "l2": 1.0, "l3": 1.0}
    )
    assert fixed.extra["split_backward"] == {"factor": pytest.approx(1.5), "runs": 1}
    again = evaluate(fixed, cluster, cuts, [1] * 4, "zbv", 4)
    assert {r: sum(again.stages[k].compute_s for k in ks) for r, ks in hosted.items()} == pytest.approx(want)
    same = evaluate(fixed, cluster, ["l1"], [1, 1], "1f1b", 4)
    assert [s.compute_s for s in same.stages] == pytest.approx([s.compute_s for s in fused.stages])
    twice = calibrate_runs(fixed, runs)
    assert twice.extra["split_backward"]["factor"] == pytest.approx(1.5)
    assert [n.compute_ms for n in twice.nodes] == pytest.approx([n.compute_ms for n in fixed.nodes])
    alone = calibrate_runs(fixed, runs[1:])  # measured what g predicts: the layers stay
    assert [n.compute_ms for n in alone.nodes] == pytest.approx([n.compute_ms for n in fixed.nodes])


def test_runs_that_disagree_are_named() -> None:
    profile, plan = _plan()
    runs = [Measured(plan, {0: 0.039 * f, 1: 0.036 * f}, None, f"run{f}") for f in (1.0, 1.05, 1.6)]
    note = disagreement(profile, runs)
    assert note is not None and "run1.6 1.60x" in note and "run1.05" not in note and "1.05x" in note
    assert disagreement(profile, runs[:2]) is None and disagreement(profile, runs[2:]) is None


def test_run_batch_size_rescales_linearly() -> None:
    profile, plan = _plan()
    fixed = calibrate(profile, plan, {0: 0.039, 1: 0.036}, batch_size=2 * (profile.batch_size or 1))
    assert fixed.total_compute_ms == pytest.approx(profile.total_compute_ms / 2)


def test_unmeasured_or_unknown_stage_is_an_error() -> None:
    """A stage the run did not measure would keep its profiled times, silently: refused."""
    profile, plan = _plan()
    with pytest.raises(PipeplanError, match="no time for stage 0"):
        calibrate(profile, plan, {1: 0.072}, batch_size=None)
    with pytest.raises(PipeplanError, match="stage 5"):
        calibrate(profile, plan, {5: 1.0}, batch_size=None)


def test_load_run_times(tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    doc = {
        "schema": "pipeplan.metrics/1",
        "batch_size": 8,
        "stages": [{"stage": 0, "compute_s_per_minibatch": 0.5, "compute_cpu_share": 0.75}],
    }
    path.write_text(json.dumps(doc))
    run = load_run_times(path)
    assert run.stage_s == {0: 0.5} and run.batch_size == 8 and run.cpu_share == {0: 0.75}
    path.write_text(json.dumps({"schema": "something/else"}))
    with pytest.raises(PipeplanError, match=r"not a pipeplan metrics\.json"):
        load_run_times(path)
    with pytest.raises(PipeplanError, match="pipeplan run"):
        load_run_times(tmp_path / "none.json")
    path.write_text(json.dumps({**doc, "machine": {"loadavg_1min": 3.5, "cpus": 2}}))
    assert (load_run_times(path).load, load_run_times(path).cpus) == (3.5, 2)
    path.write_text(json.dumps({**doc, "schedule": "interleaved"}))
    with pytest.raises(PipeplanError, match="interleaved run that does not say which stages"):
        load_run_times(path)
    ranks = [{"rank": 0, "stage": 0, "hosted": [0, 2]}, {"rank": 1, "stage": 1, "hosted": [1, 3]}]
    path.write_text(json.dumps({**doc, "schedule": "interleaved", "ranks": ranks}))
    assert load_run_times(path).hosted == {0: (0, 2), 1: (1, 3)}


def test_time_slicing_comes_out_where_the_plan_prices_the_hosts_cores() -> None:
    """A plan with ``cluster.cores`` counts CPU ranks sharing cores in its host bound, so calibration
    takes the device's own seconds (wall x share of a core); elsewhere the wall seconds."""
    _, plan = _plan()
    run = RunTimes({0: 0.2, 1: 0.1}, 8, "m.json", cpu_share={0: 0.5})
    assert device_seconds(plan, run) == {0: 0.2, 1: 0.1}
    shared = replace(plan, cluster=replace(plan.cluster, cores=1))
    assert device_seconds(shared, run) == pytest.approx({0: 0.1, 1: 0.1})


def test_an_estimated_profile_gets_its_device_model_corrected() -> None:
    """A run twice as slow as an h100 estimate: the device model's work becomes twice as slow."""
    from partitioner.calibration.stage_times import Measured, calibrated_device
    from partitioner.hardware.devices import PRESETS, device_model_to_json

    profile, plan = _plan()
    measured = {s.index: 2.0 * s.compute_s for s in plan.stages}
    run = Measured(plan, measured, profile.batch_size)
    assert calibrated_device(profile, [run], "run/metrics.json") is None  # measured: nothing to correct
    estimated = replace(profile, extra={"estimate": {"device_model": device_model_to_json(PRESETS["h100"])}})
    device = calibrated_device(estimated, [run], "run/metrics.json")
    assert device is not None and device.name == "h100"
    assert device.memory_efficiency == pytest.approx(PRESETS["h100"].memory_efficiency / 2)
    assert device.launch_s == pytest.approx(2 * PRESETS["h100"].launch_s)
    assert "run/metrics.json" in device.sources["matmul_efficiency"]


def test_a_run_under_other_work_is_refused_and_named() -> None:
    """2 ranks on 2 cores: load 2 is the run's own; load 4 is 1 per core of other work (refused,
    saying what to do); a stage with a third of a core is named either way; no record: a note."""
    _, plan = _plan()
    quiet = RunTimes({0: 0.2, 1: 0.1}, 8, "m.json", load=2.2, cpus=2)
    assert load_verdict(plan, quiet)[0] is None
    busy = replace(quiet, load=4.0, cpu_share={0: 0.35, 1: 0.9})
    refusal, notes = load_verdict(plan, busy)
    assert refusal is not None and "load 4.0 on 2 cores" in refusal and "--accept-load" in refusal
    assert "quiet machine" in refusal
    assert any("stage 0" in n and "35%" in n for n in notes) and not any("stage 1" in n for n in notes)
    unknown = replace(quiet, load=None, cpus=None)
    assert load_verdict(plan, unknown)[0] is None
    assert any("does not record the machine's load" in n for n in load_verdict(plan, unknown)[1])


def test_a_run_of_another_model_or_precision_is_refused() -> None:
    profile, plan = _plan()
    plan = replace(plan, model="vgg16", profile="profiles/vgg16/profile.json")
    check_run(Path("pkg"), plan, profile, RunTimes({0: 0.1}, 8, "m.json", model="vgg16"))
    with pytest.raises(PipeplanError, match="measured gpt2, but pkg is a package of vgg16"):
        check_run(Path("pkg"), plan, profile, RunTimes({0: 0.1}, 8, "m.json", model="gpt2"))
    with pytest.raises(PipeplanError, match=r"trained at bf16, but .* was measured at fp32"):
        check_run(Path("pkg"), plan, profile, RunTimes({0: 0.1}, 8, "m.json", precision="bf16"))
    with pytest.raises(PipeplanError, match="ran stages 0, 1, which pkg does not place on one rank"):
        check_run(Path("pkg"), plan, profile, RunTimes({0: 0.1}, 8, "m.json", hosted={0: (0, 1)}))
