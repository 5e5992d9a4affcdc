"""Checkpoint + resume reproduces an uninterrupted run; user datasets are read in order by step."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from runtime.checkpoints import step_folders as checkpoint
from runtime.checkpoints.read_tensors import Tensors
from runtime.checkpoints.step_folders import resume_point, saved_tensors
from runtime.datasets.minibatches import DatasetBatches, make_batches
from runtime.errors import JobFailed
from runtime.packages.load import import_package
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


_ADAMW = {"optimizer": "adamw", "lr": 0.05, "weight_decay": 0.1, "lr_schedule": "cosine", "warmup_steps": 2}
# (schedule, replicas, package layout): interleaved lays 4 stages on 2 ranks, zbv as a V
_LAYOUTS = [
    ("pipedream", (1, 1, 1), {}),
    ("1f1b", (1, 1, 1), {}),
    ("gpipe", (1, 1, 1), {}),
    ("zb1p", (1, 1, 1), {}),
    ("interleaved", (1, 1, 1, 1), {"virtual": 2}),
    ("zbv", (1, 1, 1, 1), {"virtual": 2, "v_shape": True}),
]


def _assert_same_checkpoint(a: Path, b: Path, step: int, stages: int) -> None:
    for k in range(stages):
        want, got = stage_state(a, step, k), stage_state(b, step, k)
        assert want.keys() == got.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=f"stage{k}.{name}")
    saved = saved_tensors(a, step, prefix="optimizer.state.")
    assert saved == saved_tensors(b, step, prefix="optimizer.state.") and saved
    want, got = Tensors.open(a / f"step-{step}"), Tensors.open(b / f"step-{step}")
    assert want.specs == got.specs


@pytest.mark.parametrize(("schedule", "replicas", "layout"), _LAYOUTS, ids=[s for s, _, _ in _LAYOUTS])
def test_resume_is_bit_exact_with_adamw_cosine_warmup_clipping_and_dropout(
    tmp_path: Path, schedule: str, replicas: tuple[int, ...], layout: dict[str, Any]
) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas, schedule, microbatches=2, batch_size=4, **layout)
    _with_dropout(pkg)
    clip = {} if schedule == "pipedream" else {"clip_grad_norm": 0.5}  # pipedream's stages step apart
    common = {"schedule": schedule, "checkpoint_every": 2, **_ADAMW, **clip}
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    first = run(pkg, steps=4, checkpoint_dir=str(whole), **common)
    run(pkg, steps=4, checkpoint_dir=str(parts), **common)
    shutil.rmtree(parts / "step-4")  # as if the run had stopped after step 2
    # A newer step whose rank file a crash truncated: resume falls back to step 2.
    shutil.copytree(whole / "step-4", parts / "step-4")
    data = parts / "step-4" / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    assert resume_point(parts).step == 2
    second = run(pkg, steps=4, checkpoint_dir=str(parts), resume=True, **common)
    _assert_same_checkpoint(whole, parts, 4, len(replicas))
    assert second["losses"] == first["losses"][2:]


_KILL = """

_ARMED = {armed!r}
_AFTER = {after!r}


def _die_mid_checkpoint(module, state, prefix, local_metadata):
    \"\"\"A test's fault: SIGKILL this rank while it collects a checkpoint after the one of _AFTER.\"\"\"
    import os, signal
    if os.path.exists(_ARMED) and os.path.isdir(_AFTER) and next(module.parameters()).device.type != "meta":
        os.unlink(_ARMED)
        os.kill(os.getpid(), signal.SIGKILL)


_init = Stage1.__init__
Stage1.__init__ = lambda self: (_init(self), self._register_state_dict_hook(_die_mid_checkpoint))[0]
"""


def test_a_rank_killed_while_a_checkpoint_is_written_leaves_the_previous_one_to_resume_bit_exactly(
    tmp_path: Path,
) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1, 1), microbatches=2, batch_size=4)
    _with_dropout(pkg)
    whole, parts, armed = tmp_path / "whole", tmp_path / "parts", tmp_path / "armed"
    stage1 = pkg / "stage1.py"
    stage1.write_text(stage1.read_text() + _KILL.format(armed=str(armed), after=str(parts / "step-2")))
    common = {"schedule": "1f1b", "checkpoint_every": 2, **_ADAMW}
    first = run(pkg, steps=6, checkpoint_dir=str(whole), **common)
    armed.touch()
    with pytest.raises(JobFailed, match=r"rank 1 \(stage 1\) failed: the process died \(signal 9\)"):
        run(pkg, steps=6, checkpoint_dir=str(parts), **common)
    assert not armed.exists() and checkpoint.steps_in(parts) == [2]
    second = run(pkg, steps=6, checkpoint_dir=str(parts), resume=True, **common)
    _assert_same_checkpoint(whole, parts, 6, 3)
    assert second["losses"] == first["losses"][2:]


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
