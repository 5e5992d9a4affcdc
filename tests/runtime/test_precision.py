"""Mixed precision: bf16 runs against single-process bf16 training, fp16's loss scaling agreed by every
rank (an inf injected on one rank skips the step everywhere and backs the scale off), the scale in
checkpoints, and the settings' checks."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from runtime.checkpoints.read_tensors import read_values
from runtime.datasets.minibatches import SyntheticBatches
from runtime.errors import RunError
from runtime.executing.loss_scale import LossScaler
from runtime.packages.job_config import load_job
from runtime.packages.load import import_package
from runtime.precision import autocast, check_precision
from runtime.settings.run_options import RunOptions, from_argv, to_argv
from tests.runtime.helpers import run, stage_state
from tests.runtime.packages import IN_DIM, write_package

torch.set_num_threads(1)

# Stage 0 of the chain package, with an inf written into its weight's gradient at its third forward on
# rank 0 only (one forward per step: replica 0 of two, 2 microbatches): the injected overflow.
_POISONED_STAGE0 = f"""
import os

import torch
from torch import nn


class _Poison(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, poison):
        ctx.poison = poison
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return (torch.full_like(grad, float("inf")) if ctx.poison else grad), None


class Stage0(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({IN_DIM}, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += torch.is_grad_enabled()  # (start-up's forward counts: it runs with gradients on)
        poison = self.calls == 4 and os.environ.get("RANK") == "0"
        w = _Poison.apply(self.fc.weight, poison)
        return torch.tanh(nn.functional.linear(x, w, self.fc.bias))
"""


def _poisoned(folder: Path) -> Path:
    pkg = write_package(folder, "chain", replicas=(2, 1), microbatches=2, batch_size=4)
    (pkg / "stage0.py").write_text(textwrap.dedent(_POISONED_STAGE0).lstrip())
    return pkg


def test_precision_values_are_checked_and_fp16_refuses_pipedream() -> None:
    with pytest.raises(RunError, match="unknown --precision 'fp8'"):
        check_precision("fp8")
    with pytest.raises(RunError, match=r"use --precision bf16 .* or --schedule 1f1b or gpipe"):
        check_precision("fp16", "pipedream")
    check_precision("bf16", "pipedream")
    check_precision("fp16", "1f1b")
    assert RunOptions("p", precision="bf16") == from_argv(to_argv(RunOptions("p", precision="bf16")))


def test_a_plan_without_precision_reads_as_fp32_and_the_option_overrides_it(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", replicas=(1, 1))
    plan = json.loads((pkg / "plan.json").read_text())
    plan.pop("precision")
    (pkg / "plan.json").write_text(json.dumps(plan))
    assert load_job(pkg).precision == "fp32"
    job = load_job(pkg, precision="bf16")
    assert (job.precision, job.plan_precision) == ("bf16", "fp32")
    plan["precision"] = "fp16"
    (pkg / "plan.json").write_text(json.dumps(plan))
    assert load_job(pkg, schedule="gpipe").precision == "fp16"
    with pytest.raises(RunError, match="fp16 needs a synchronous schedule"):
        load_job(pkg, schedule="pipedream")


def test_loss_scaler_follows_grad_scaler_rules_and_reads_its_state() -> None:
    scaler = LossScaler(None, growth_interval=2)  # type: ignore[arg-type]
    scaler.update(True)
    assert (scaler.scale, scaler.growth_tracker) == (2.0**15, 0)
    scaler.update(False)
    scaler.update(False)
    assert (scaler.scale, scaler.growth_tracker) == (2.0**16, 0)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=128.0, growth_interval=7)
    scaler.load_state_dict(torch_scaler.state_dict())
    assert (scaler.scale, scaler.growth_interval) == (128.0, 7)
    assert scaler.state_dict().keys() == torch_scaler.state_dict().keys()


def _bf16_reference(
    package: Path, steps: int, micro: int, batch: int, lr: float, precision: str
) -> list[float]:
    """The unsplit model in one process under the same autocast, gradient accumulation over the same
    microbatches, plain SGD: the loss of every step."""
    pkg = import_package(package)
    model, loss_fn = pkg.full_model(0), pkg.criterion()
    data = SyntheticBatches(pkg, ["input0"], batch, seed=0)
    optim = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        (x,), y = data.inputs(step), data.targets(step)
        total = 0.0
        for xs, ys in zip(x.tensor_split(micro), y.tensor_split(micro), strict=True):
            with autocast(precision, "cpu"):
                loss = loss_fn(model(xs), ys) * (xs.shape[0] / batch)
            loss.backward()
            total += float(loss.detach())
        optim.step()
        optim.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.slow
def test_bf16_run_stays_within_2_percent_of_single_process_bf16(tmp_path: Path) -> None:
    steps, micro, batch, lr = 20, 4, 8, 0.05
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1, 1), microbatches=micro, batch_size=batch)
    metrics = run(pkg, steps=steps, schedule="1f1b", lr=lr, precision="bf16")
    assert metrics["precision"] == "bf16"
    got = metrics["losses"]
    want = _bf16_reference(pkg, steps, micro, batch, lr, "bf16")
    fp32 = _bf16_reference(pkg, steps, micro, batch, lr, "fp32")
    assert len(got) == steps
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert worst <= 0.02, (worst, got, want)
    # and the run did compute in bf16: it differs from fp32 training where bf16 training does
    assert max(abs(g - f) / abs(f) for g, f in zip(got, fp32, strict=True)) > 1e-4


@pytest.mark.slow
def test_an_inf_on_one_rank_skips_the_step_on_every_rank_and_backs_the_scale_off(tmp_path: Path) -> None:
    pkg = _poisoned(tmp_path / "pkg")
    ckpt = tmp_path / "ckpt"
    metrics = run(pkg, steps=5, schedule="1f1b", lr=0.1, precision="fp16", checkpoint_dir=str(ckpt),
                  checkpoint_every=1)  # fmt: skip
    ranks = {r["rank"]: r for r in metrics["ranks"]}
    # rank 0 wrote the inf, its replica (rank 1) summed it in; stage 1 (rank 2) never saw one
    assert [list(ranks[r]["overflow_steps"]) for r in (0, 1, 2)] == [[3], [3], []]
    assert all(list(ranks[r]["skipped_steps"]) == [3] for r in ranks)
    assert all(ranks[r]["loss_scale"] == 2.0**15 for r in ranks)
    assert all(math.isfinite(loss) for loss in metrics["losses"])
    for stage in (0, 1):  # no stage moved at step 3, every stage moved at step 4
        before, skipped, after = (stage_state(ckpt, s, stage) for s in (2, 3, 4))
        assert all(torch.equal(before[n], skipped[n]) for n in before), f"stage {stage} stepped at 3"
        assert not all(torch.equal(skipped[n], after[n]) for n in skipped), f"stage {stage} froze at 4"
    scale = [read_values(ckpt / f"step-{s}", ["loss_scale.scale"])["loss_scale.scale"] for s in (2, 3)]
    assert scale == [2.0**16, 2.0**15]


@pytest.mark.slow
def test_the_loss_scale_survives_a_resume(tmp_path: Path) -> None:
    pkg = _poisoned(tmp_path / "pkg")
    whole = run(pkg, steps=6, schedule="1f1b", precision="fp16", run_dir=str(tmp_path / "a"))
    ckpt = str(tmp_path / "ckpt")
    run(pkg, steps=4, schedule="1f1b", precision="fp16", checkpoint_dir=ckpt, run_dir=str(tmp_path / "b"))
    resumed = run(pkg, steps=6, schedule="1f1b", precision="fp16", checkpoint_dir=ckpt, resume=True,
                  run_dir=str(tmp_path / "c"))  # fmt: skip
    # the resumed ranks count their forwards afresh, so none of them injects an inf again: the halved
    # scale of step 3 can only come from the checkpoint
    assert (
        {r["loss_scale"] for r in resumed["ranks"]} == {2.0**15} == {r["loss_scale"] for r in whole["ranks"]}
    )
    assert all(not r["skipped_steps"] for r in resumed["ranks"])
    assert resumed["losses"] == whole["losses"][4:]
