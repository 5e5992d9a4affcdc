"""Checkpoint + resume reproduces an uninterrupted run; user datasets are read in order by step."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from runtime.checkpoint import resume_point, saved_tensors
from runtime.data import DatasetBatches, make_batches
from runtime.package import import_package
from tests.runtime.helpers import run, stage_state
from tests.runtime.packages import IN_DIM, OUT_DIM, write_package

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


def _with_dropout(pkg: Path) -> Path:
    """Every stage drops 30% of its outputs: a resumed run is exact only with the generators restored."""
    for path in pkg.glob("stage*.py"):
        body = path.read_text().replace(
            "self.fc(x)", "torch.nn.functional.dropout(self.fc(x), 0.3, self.training)"
        )
        path.write_text(body)
    return pkg


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b"])
def test_resume_with_dropout_reproduces_an_uninterrupted_run(tmp_path: Path, schedule: str) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1, 1), microbatches=2, batch_size=4)
    _with_dropout(pkg)
    common = {"schedule": schedule, "lr": 0.1, "momentum": 0.9, "checkpoint_every": 2}
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run(pkg, steps=4, checkpoint_dir=str(whole), **common)
    run(pkg, steps=2, checkpoint_dir=str(parts), **common)
    # A newer step whose rank file a crash truncated: resume falls back to step 2.
    shutil.copytree(whole / "step-4", parts / "step-4")
    (parts / "step-4" / "__1_0.distcp").write_bytes((parts / "step-4" / "__1_0.distcp").read_bytes()[:100])
    assert resume_point(parts).step == 2
    run(pkg, steps=4, checkpoint_dir=str(parts), resume=True, **common)
    for k in range(3):
        want, got = stage_state(whole, 4, k), stage_state(parts, 4, k)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    assert any(k.startswith("optimizer.state.stages.0.") for k in saved_tensors(parts, 4, prefix=""))


def _dataset_file(tmp_path: Path) -> Path:
    path = tmp_path / "mydata.py"
    path.write_text(
        "import torch\n"
        "def data():\n"
        "    g = torch.Generator().manual_seed(5)\n"
        f"    x, y = torch.randn(12, {IN_DIM}, generator=g), torch.randn(12, {OUT_DIM}, generator=g)\n"
        "    return torch.utils.data.TensorDataset(x, y)\n"
    )
    return path


def test_user_dataset_trains_like_plain_training_on_the_same_batches(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    spec = f"{_dataset_file(tmp_path)}:data"
    ckpt = tmp_path / "ckpt"
    metrics = run(pkg, epochs=2, data=spec, lr=0.1, checkpoint_dir=str(ckpt))
    assert metrics["steps"] == 6  # 12 samples / batch 4 = 3 steps per epoch
    module = import_package(pkg)
    model, loss_fn = module.full_model(0), module.criterion()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = make_batches(spec, module, ["input0"], 4, seed=0, shuffle=False)
    for step in range(6):
        (x,), y = batches.inputs(step), batches.targets(step)
        for xs, ys in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
            (loss_fn(model(xs), ys) * 0.5).backward()
        optim.step()
        optim.zero_grad()
    for k in range(2):
        for name, tensor in model.stages[k].state_dict().items():
            torch.testing.assert_close(stage_state(ckpt, 6, k)[name], tensor, rtol=1e-5, atol=1e-6)


def test_shuffled_dataset_is_the_same_on_every_rank_and_differs_per_epoch(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg")
    spec = f"{_dataset_file(tmp_path)}:data"
    module = import_package(pkg)
    a = make_batches(spec, module, ["input0"], 4, seed=3, shuffle=True)
    b = make_batches(spec, module, ["input0"], 4, seed=3, shuffle=True)
    assert torch.equal(a.targets(4), b.targets(4)) and torch.equal(a.inputs(1)[0], b.inputs(1)[0])
    epoch0 = torch.cat([a.targets(s) for s in range(3)])
    epoch1 = torch.cat([a.targets(s) for s in range(3, 6)])
    assert not torch.equal(epoch0, epoch1)
    assert torch.equal(epoch0.sort(0).values, epoch1.sort(0).values)


def test_dict_batches_are_read_by_pipedream_or_argument_names() -> None:
    """A dataset of dicts keyed by the model's argument names feeds a package wired as input0, input1."""
    samples = [({"ids": torch.tensor([i, i + 1]), "mask": torch.ones(2)}, torch.tensor(i)) for i in range(4)]
    loader: DataLoader[Any] = DataLoader(samples, batch_size=2)  # type: ignore[arg-type]
    aliases = {"input0": "ids", "input1": "mask"}
    batches = DatasetBatches(loader, ["input0", "input1"], seed=0, shuffle=False, aliases=aliases)
    ids, mask = batches.inputs(1)
    assert ids.tolist() == [[2, 3], [3, 4]] and mask.shape == (2, 2)
    assert batches.targets(1).tolist() == [2, 3]
