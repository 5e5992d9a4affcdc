"""A per-stage checkpoint of pipeplan before DCP converts to today's format: every weight, optimizer
state, schedule position and generator state lands under its name, and the run resumes from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.checkpoints import step_folders as checkpoint
from runtime.checkpoints.convert_v1 import convert
from runtime.checkpoints.read_tensors import Tensors, read_stage, read_values
from runtime.errors import RunError
from runtime.executing.optimizer import OptimSettings, make_optimizer, make_scheduler
from runtime.packages.load import import_package
from tests.runtime.helpers import run
from tests.runtime.packages import write_package

SETTINGS = OptimSettings(lr=0.1, momentum=0.9)


def _write_v1(root: Path, pkg: Path, step: int) -> list[torch.nn.Module]:
    """step-N as pipeplan wrote it before DCP: stage files with torch's numbered optimizer state."""
    package, folder = import_package(pkg), root / f"step-{step}"
    folder.mkdir(parents=True)
    modules = []
    for k in range(2):
        module = package.stage(k)
        optimizer = make_optimizer(SETTINGS, module.parameters())
        scheduler = make_scheduler(SETTINGS, optimizer, 10)
        for p in module.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        scheduler.step()
        state = {
            "model": module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "optim": SETTINGS.record(),
            "scaler": None,
            "precision": "fp32",
            "step": step,
        }
        torch.save(state, folder / f"stage{k}.pt")
        torch.save({"rng": {"cpu": torch.get_rng_state()}, "step": step}, folder / f"rank{k}.pt")
        modules.append((module, optimizer))
    meta = {
        "schema": "pipeplan.checkpoint/1",
        "step": step,
        "package": str(pkg),
        "fingerprint": checkpoint.package_fingerprint(pkg),
        "world_size": 2,
        "seed": 0,
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    return modules  # type: ignore[return-value]


def test_a_per_stage_checkpoint_converts_by_name_and_resumes(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    root = tmp_path / "ck"
    made = _write_v1(root, pkg, 2)
    with pytest.raises(RunError, match="convert-checkpoint"):
        checkpoint.resume_point(root)
    assert convert(root, pkg) == [2]
    assert checkpoint.step_problem(root, 2) is None and (root / "step-2.v1" / "stage0.pt").is_file()
    for k, (module, optimizer) in enumerate(made):  # type: ignore[misc]
        for name, tensor in read_stage(root, 2, k).items():
            torch.testing.assert_close(tensor, module.state_dict()[name], rtol=0, atol=0)
        moment = optimizer.state[module.fc.weight]["momentum_buffer"]
        key = f"stages.{k}.fc.weight.momentum_buffer"
        saved = Tensors(root / "step-2", checkpoint.saved_tensors(root, 2, prefix="optimizer.state."))
        torch.testing.assert_close(saved.read([key], prefix="optimizer.state.")[key], moment, rtol=0, atol=0)
    assert read_values(root / "step-2", ["lr_scheduler.last_epoch"])["lr_scheduler.last_epoch"] == 1
    metrics = run(pkg, steps=3, lr=0.1, momentum=0.9, checkpoint_dir=str(root), resume=True)
    assert metrics["steps"] == 1 and checkpoint.steps_in(root) == [3, 2]
