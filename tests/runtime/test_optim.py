"""Optimizer settings: the learning-rate curves, bad values, and multi-process gloo runs with AdamW,
weight decay, cosine warm-up and global gradient clipping against single-process training."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.checkpoints.read_tensors import read_values
from runtime.datasets.minibatches import SyntheticBatches
from runtime.errors import RunError
from runtime.executing.optimizer import (
    OptimSettings,
    apply_settings,
    lr_factor,
    make_optimizer,
    make_scheduler,
)
from runtime.packages.load import import_package
from runtime.settings.run_options import RunOptions, from_argv, to_argv
from tests.runtime.helpers import assert_stages_equal, run, stage_state
from tests.runtime.packages import write_package

torch.set_num_threads(1)

ADAMW = {
    "optimizer": "adamw",
    "lr": 0.05,
    "weight_decay": 0.1,
    "betas": (0.8, 0.95),
    "lr_schedule": "cosine",
    "warmup_steps": 2,
}


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_curves_are_transformers_schedules_with_warmup(schedule: str) -> None:
    transformers = pytest.importorskip("transformers")
    warmup, total = 3, 10
    p = torch.nn.Parameter(torch.zeros(1))
    optim = torch.optim.SGD([p], lr=1.0)
    make = getattr(transformers, f"get_{schedule}_schedule_with_warmup")
    kwargs = {"num_warmup_steps": warmup} | ({} if schedule == "constant" else {"num_training_steps": total})
    sched = make(optim, **kwargs)
    for step in range(total):
        assert lr_factor(step, schedule, warmup, total) == pytest.approx(optim.param_groups[0]["lr"]), step
        optim.step()
        sched.step()


def test_lr_curve_values() -> None:
    assert [lr_factor(s, "cosine", 2, 6) for s in range(6)] == pytest.approx(
        [0, 0.5, 1, 0.8536, 0.5, 0.1464], abs=1e-4
    )
    assert [lr_factor(s, "linear", 0, 4) for s in range(4)] == [1, 0.75, 0.5, 0.25]
    assert lr_factor(9, "constant", 10, 20) == 0.9


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({"weight_decay": -0.1}, "--weight-decay"),
        ({"betas": (0.9, 1.0)}, "--betas"),
        ({"lr_schedule": "step"}, "--lr-schedule"),
        ({"optimizer": "rmsprop"}, "--optimizer"),
        ({"clip_grad_norm": math.inf}, "--clip-grad-norm"),
        ({"clip_grad_norm": 0.0}, "--clip-grad-norm"),
        ({"nesterov": True}, "--nesterov"),
        ({"warmup_steps": -1}, "--warmup-steps"),
        ({"lr": math.nan}, "--lr"),
    ],
)
def test_bad_settings_name_the_option(bad: dict[str, Any], words: str) -> None:
    with pytest.raises(RunError, match=words):
        OptimSettings(**bad)


def test_clipping_is_refused_under_pipedream() -> None:
    with pytest.raises(RunError, match="synchronous"):
        OptimSettings(clip_grad_norm=1.0).check_schedule("pipedream")
    OptimSettings(clip_grad_norm=1.0).check_schedule("1f1b")
    OptimSettings(clip_grad_norm=1.0).check_schedule("interleaved")


def test_accepted_changes_replace_what_a_checkpoint_loaded() -> None:
    """A resume with other settings (accepted): the loaded groups take the new rate, decay and betas,
    and the next step's rate is the new schedule's at the step reached (a horizon 8 -> 12)."""
    old, new = OptimSettings(**ADAMW), OptimSettings(**{**ADAMW, "lr": 0.02, "weight_decay": 0.2})
    params = [torch.nn.Parameter(torch.ones(2))]
    optimizer = make_optimizer(old, params)
    scheduler = make_scheduler(new, optimizer, 12)
    scheduler.load_state_dict(
        {**make_scheduler(old, make_optimizer(old, params), 8).state_dict(), "last_epoch": 5}
    )
    apply_settings(new, optimizer, scheduler)
    (group,) = optimizer.param_groups
    assert (group["initial_lr"], group["weight_decay"], group["betas"]) == (0.02, 0.2, new.betas)
    assert group["lr"] == pytest.approx(0.02 * lr_factor(5, "cosine", ADAMW["warmup_steps"], 12))


def test_settings_survive_the_torchrun_command_line() -> None:
    sgd = {**ADAMW, "optimizer": "sgd", "nesterov": True, "momentum": 0.9}  # (nesterov: sgd only)
    options = RunOptions.of("pkg", steps=5, clip_grad_norm=0.5, **sgd)
    assert options.optim == OptimSettings(clip_grad_norm=0.5, **sgd)
    assert from_argv(to_argv(options)) == options


def _reference(
    package: Path, steps: int, micro: int, batch: int, settings: OptimSettings
) -> tuple[torch.nn.Module, list[float]]:
    """The unsplit model in one process: gradient accumulation over the same microbatches, torch's
    AdamW or SGD, LambdaLR over steps and ``clip_grad_norm_``. Returns the model and the norms."""
    pkg = import_package(package)
    model, loss_fn = pkg.full_model(0), pkg.criterion()
    data = SyntheticBatches(pkg, ["input0"], batch, seed=0)
    s = settings
    if s.optimizer == "adamw":
        optim: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(), lr=s.lr, betas=s.betas, weight_decay=s.weight_decay
        )
    else:
        optim = torch.optim.SGD(model.parameters(), lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda step: lr_factor(step, s.lr_schedule, s.warmup_steps, steps)
    )
    norms = []
    for step in range(steps):
        (x,), y = data.inputs(step), data.targets(step)
        for xs, ys in zip(x.tensor_split(micro), y.tensor_split(micro), strict=True):
            (loss_fn(model(xs), ys) * (xs.shape[0] / batch)).backward()
        if s.clip_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip_grad_norm)))
        optim.step()
        optim.zero_grad()
        sched.step()
    return model, norms


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "replicas"), [("1f1b", (2, 1)), ("gpipe", (1, 1)), ("interleaved", (1, 1, 1, 1))]
)
def test_adamw_cosine_warmup_and_clipping_equal_plain_training(
    tmp_path: Path, schedule: str, replicas: tuple[int, ...]
) -> None:
    """(interleaved: 4 stages on 2 ranks, each rank clipping its two chunks with one all-reduce)"""
    steps, micro, batch = 5, 4, 8
    settings = OptimSettings(**ADAMW, clip_grad_norm=0.3)
    virtual = 2 if schedule == "interleaved" else 1
    pkg = write_package(
        tmp_path / "pkg", "chain", replicas, microbatches=micro, batch_size=batch, virtual=virtual
    )
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=steps, schedule=schedule, checkpoint_dir=str(ckpt), clip_grad_norm=0.3, **ADAMW)
    model, norms = _reference(pkg, steps, micro, batch, settings)
    assert sum(n > 0.3 for n in norms) >= 2, f"clipping must bind for the test to mean anything: {norms}"
    assert_stages_equal(ckpt, steps, model, len(replicas))
    assert (
        read_values(ckpt / f"step-{steps}", ["lr_scheduler.last_epoch"])["lr_scheduler.last_epoch"] == steps
    )
    optim = json.loads((ckpt / f"step-{steps}" / "meta.json").read_text())["optim"]
    assert optim["optimizer"] == "adamw" and optim["lr_schedule"] == "cosine"


@pytest.mark.slow
def test_clipping_counts_a_tied_weight_once_across_stages_and_replicas(tmp_path: Path) -> None:
    steps, micro, batch = 3, 2, 4
    pkg = write_package(tmp_path / "pkg", "tied", replicas=(2, 1), microbatches=micro, batch_size=batch)
    settings = OptimSettings(lr=0.5, momentum=0.5, clip_grad_norm=0.2)
    model, norms = _reference(pkg, steps, micro, batch, settings)
    assert all(n > 0.2 for n in norms), norms
    assert _tied_share(pkg, batch) > 0.05, "counting the tie twice must change the norm for this to test it"
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=steps, schedule="1f1b", lr=0.5, momentum=0.5, clip_grad_norm=0.2, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, steps, model, 2)


def _tied_share(package: Path, batch: int) -> float:
    """How much larger the first step's gradient norm is with the tied weight counted twice."""
    pkg = import_package(package)
    model, loss_fn = pkg.full_model(0), pkg.criterion()
    assert model.stages[0].fc.weight is model.stages[1].w
    data = SyntheticBatches(pkg, ["input0"], batch, seed=0)
    loss_fn(model(*data.inputs(0)), data.targets(0)).backward()
    once = sum(float(p.grad.square().sum()) for p in model.parameters() if p.grad is not None)
    twice = once + float(model.stages[1].w.grad.square().sum())
    return math.sqrt(twice / once) - 1


@pytest.mark.slow
def test_resume_continues_the_learning_rate_schedule(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    # Rates 0, 1, 0.75, 0.25: a schedule restarted at the resume would use 1 for the last step.
    common: dict[str, Any] = {
        "steps": 4,
        "schedule": "1f1b",
        "checkpoint_every": 2,
        **ADAMW,
        "warmup_steps": 1,
    }
    ckpt = tmp_path / "ckpt"
    run(pkg, checkpoint_dir=str(ckpt), **common)
    want = [stage_state(ckpt, 4, k) for k in range(2)]
    shutil.rmtree(ckpt / "step-4")
    run(pkg, checkpoint_dir=str(ckpt), resume=True, **common)
    for k in range(2):
        got = stage_state(ckpt, 4, k)
        for name in want[k]:
            torch.testing.assert_close(got[name], want[k][name], rtol=0, atol=0)


@pytest.mark.slow
def test_pipedream_schedule_counts_minibatches_on_every_stage(tmp_path: Path) -> None:
    """Stage 0's two replicas step once per round of two minibatches, stage 1 once per minibatch:
    both end at the same point of the warm-up (4 of 8 minibatches: half the rate)."""
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(2, 1), microbatches=1, batch_size=4)
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=4, schedule="pipedream", lr=0.2, warmup_steps=8, checkpoint_dir=str(ckpt))
    assert read_values(ckpt / "step-4", ["lr_scheduler.last_epoch"])["lr_scheduler.last_epoch"] == 4
    for k in range(2):
        key = f"optimizer.param_groups.stages.{k}.fc.weight.lr"
        assert read_values(ckpt / "step-4", [key])[key] == pytest.approx(0.1), k
