"""The accuracy contract end to end: `partition` keeps each stage's simulated bubble in plan.json, and
`run` sets the plan's per-stage compute, communication and bubble beside what it measured, in
metrics.json and in an 80-column table; a plan.json from before the bubble still runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli import main
from partitioner.graph import load_profile, save_profile
from partitioner.optimizer.pricing.simulate import simulate, stage_bubbles
from partitioner.plan import load_plan
from tests.partitioner.optimizer.conftest import make_profile
from tests.runtime.packages import write_package

torch.set_num_threads(1)


def test_partition_keeps_each_stage_s_simulated_bubble(tmp_path: Path) -> None:
    profile = make_profile(
        [(10, 20, 0, 1e6), (30, 50, 0, 2e6), (5, 10, 0, 1e6)], [(0, 1), (1, 2)], batch_size=8
    )
    save_profile(profile, tmp_path / "p.json")
    args = ["--profile", str(tmp_path / "p.json"), "--gpus", "3", "--schedule", "1f1b", "--microbatches", "4",
            "--cuts", "l0,l1", "--replicas", "1,1,1"]  # fmt: skip
    result = CliRunner().invoke(main, ["partition", *args, "-o", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    (path,) = (tmp_path / "m").glob("*/gpus=3/plan.json")
    plan = load_plan(path)
    written = [s.bubble_fraction for s in plan.stages]
    assert None not in written and len(set(written)) > 1
    assert written == pytest.approx(list(stage_bubbles(plan, simulate(plan, profile))))


@pytest.mark.slow
def test_run_reports_every_stage_against_plan_json_and_an_old_plan_still_runs(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    doc = json.loads((pkg / "plan.json").read_text())
    doc["stages"][0].update(compute_s=0.004, comm_s=0.001, bubble_fraction=0.2)
    doc["stages"][1].update(compute_s=0.003, comm_s=0.0)  # no bubble_fraction: as plans written before it
    (pkg / "plan.json").write_text(json.dumps(doc))
    result = CliRunner().invoke(
        main, ["run", str(pkg), "--steps", "3", "--timeout", "30", "--measure-memory"]
    )
    assert result.exit_code == 0, result.output
    first, second = json.loads((pkg / "run" / "metrics.json").read_text())["stages"]
    predicted = (
        "predicted_compute_s_per_minibatch",
        "predicted_comm_s_per_minibatch",
        "predicted_bubble_fraction",
    )
    assert [first[k] for k in predicted] == [0.004, 0.001, 0.2]  # plan.json's, as written
    assert [second[k] for k in predicted] == [0.003, 0.0, None]  # no bubble in the plan: not predicted
    for stage in (first, second):  # measured on every stage
        assert stage["comm_s_per_minibatch"] > 0 and 0 < stage["bubble_fraction"] < 1
    assert first["compute_measured_over_predicted"] == pytest.approx(first["compute_s_per_minibatch"] / 0.004)
    assert first["bubble_measured_over_predicted"] == pytest.approx(first["bubble_fraction"] / 0.2)
    assert second["bubble_measured_over_predicted"] is None
    lines = result.output.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("per stage, per minibatch"))
    assert lines[top - 2].lstrip().startswith("time per minibatch")  # under the total line
    table = lines[top : top + 7]
    assert table[5].split()[:2] == ["0", "4.00"]  # stage 0's predicted compute, in ms
    assert table[6].split()[-3:-1] == ["-", f"{second['bubble_fraction']:.2f}"]
    assert max(map(len, table)) <= 80


_MLP = """
import torch
from torch import nn


def model() -> nn.Module:
    blocks = [nn.Sequential(nn.Linear(768, 768), nn.ReLU()) for _ in range(5)]
    return nn.Sequential(*blocks, nn.Linear(768, 10))


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 768),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 10, (batch_size,))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)
"""


@pytest.mark.slow
def test_a_rank_starts_the_next_minibatch_while_a_later_one_ends_the_last(tmp_path: Path) -> None:
    """What the simulation's steady period rests on (``simulate.STEADY_MINIBATCHES``): the runtime has
    no barrier at the step. zb1p with one block on stage 0 and four on stage 1: in the trace, rank 0's
    first forward of each minibatch starts before rank 1's last W of the one before has ended, and
    the plan's time is below the span of the one minibatch it shows."""
    (tmp_path / "mlp.py").write_text(_MLP.lstrip())
    profile, models, trace = tmp_path / "profile.json", tmp_path / "models", tmp_path / "trace.json"
    for args in (
        ["profile", f"{tmp_path / 'mlp.py'}:model", "--batch-size", "256", "--no-fixed-cost",
         "-o", str(profile)],
        ["partition", "--profile", str(profile), "--gpus", "2", "--schedule", "zb1p", "--microbatches", "2",
         "--cuts", "0.1", "--replicas", "1,1", "-o", str(models)],
    ):  # fmt: skip
        result = CliRunner().invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
    (pkg,) = models.glob("*/gpus=2")
    plan = load_plan(pkg / "plan.json")
    sim = simulate(plan, load_profile(profile))
    assert plan.predicted.time_per_minibatch_s < max(e.end_s for e in sim.events) * 0.99
    result = CliRunner().invoke(
        main, ["run", str(pkg), "--steps", "4", "--timeout", "60", "--trace", str(trace)]
    )
    assert result.exit_code == 0, result.output
    spans = {
        (e["pid"], e["name"]): (e["ts"], e["ts"] + e["dur"])
        for e in json.loads(trace.read_text())["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") == "compute"
    }
    for n in (1, 2, 3):
        assert spans[(0, f"F{2 * n}")][0] < spans[(1, f"W{2 * n - 1}")][1]
