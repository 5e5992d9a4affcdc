"""Plain single-process training of a package's whole model, the reference 3D runs are held to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runtime.checkpoints.read_tensors import read_stage
from runtime.datasets.minibatches import SyntheticBatches
from runtime.packages.load import import_package, read_wiring

__all__ = ["assert_trained_as_plain", "plain_state"]


def plain_state(
    package: Path, steps: int, microbatches: int, batch_size: int, **sgd: Any
) -> dict[str, torch.Tensor]:
    """The original model's weights after ``steps`` SGD steps of gradient accumulation over the same
    microbatches a run takes (synthetic data, seed 0)."""
    pkg = import_package(package)
    model, loss_fn = pkg.full_model(0), pkg.criterion()
    model.train()
    names = read_wiring(pkg, len(pkg.STAGES)).stage_inputs[0]
    data = SyntheticBatches(pkg, names, batch_size, seed=0)
    optim = torch.optim.SGD(model.parameters(), **sgd)
    for step in range(steps):
        inputs, target = data.inputs(step), data.targets(step)
        parts = [t.tensor_split(microbatches) for t in inputs]
        for j, y in enumerate(target.tensor_split(microbatches)):
            out = model(*(p[j] for p in parts))
            (loss_fn(out, y) * (y.shape[0] / target.shape[0])).backward()
        optim.step()
        optim.zero_grad()
    named = [*model.named_buffers(remove_duplicate=False), *model.named_parameters(remove_duplicate=False)]
    return {k: v.detach() for k, v in named}


def assert_trained_as_plain(
    ckpt: Path, step: int, stages: int, want: dict[str, torch.Tensor], rtol: float = 1e-5
) -> int:
    """Every stage's checkpointed weights at ``step`` equal ``want`` within ``rtol`` relative (of the
    tensor's largest value); returns how many tensors were compared."""
    seen = 0
    for k in range(stages):
        for name, got in read_stage(ckpt, step, k).items():
            ref = want[name]
            scale = float(ref.abs().max()) or 1.0
            torch.testing.assert_close(
                got, ref, rtol=0, atol=rtol * scale, msg=lambda m, n=name, s=k: f"stage {s} {n}: {m}"
            )
            seen += 1
    return seen
