"""Single-process references the distributed runs are compared with, and a launcher for tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.checkpoints.read_tensors import read_stage
from runtime.datasets.minibatches import SyntheticBatches
from runtime.job.launch import launch
from runtime.packages.load import import_package
from runtime.schedule import build, pipeline
from runtime.settings.run_options import RunOptions

__all__ = ["pipedream_reference", "plain_training", "run", "stage_state"]


def run(package: Path, **kwargs: Any) -> dict[str, Any]:
    """Launch a package on local gloo ranks (fork start, short timeout) and return rank 0's metrics."""
    kwargs.setdefault("timeout", 30)
    kwargs.setdefault("backend", "gloo")
    kwargs.setdefault("start_method", "forkserver")
    result = launch(RunOptions.of(str(package), **kwargs))
    assert result is not None
    return result


def stage_state(ckpt: Path, step: int, stage: int) -> dict[str, torch.Tensor]:
    """Stage ``stage``'s weights at ``step`` under its own names (read from the DCP checkpoint)."""
    return read_stage(ckpt, step, stage)


def assert_one_step_is_the_plain_gradient(package: Path, ckpt: Path, stages: int, tol: float) -> None:
    """After one SGD step at lr 1 (4 microbatches of a batch of 8), every weight moved by exactly the
    gradient of plain accumulation, and every weight moved."""
    before = import_package(package).full_model(0)
    after = plain_training(package, 1, 4, 8, lr=1.0)
    for k in range(stages):
        got = stage_state(ckpt, 1, k)
        start, want = before.stages[k].state_dict(), after.stages[k].state_dict()
        for name in want:
            grad, plain = start[name] - got[name], start[name] - want[name]
            assert grad.abs().sum() > 0, f"stage{k}.{name} got no gradient"
            torch.testing.assert_close(grad, plain, rtol=tol, atol=tol, msg=f"stage{k}.{name}")


def assert_stages_equal(
    ckpt: Path, step: int, model: nn.Module, stages: int, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Every stage's checkpoint at ``step`` equals ``model.stages[k]``'s weights, name for name."""
    for k in range(stages):
        got, want = stage_state(ckpt, step, k), model.stages[k].state_dict()
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=f"stage{k}.{name}")


def _micro(data: SyntheticBatches, step: int, m: int) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    (x,), y = data.inputs(step), data.targets(step)
    return [
        (a, b, a.shape[0] / x.shape[0]) for a, b in zip(x.tensor_split(m), y.tensor_split(m), strict=True)
    ]


def plain_training(
    package: Path, steps: int, microbatches: int, batch_size: int, optimizer: str = "sgd", **opt: Any
) -> nn.Module:
    """The whole model in one process, gradient accumulation over the same microbatches."""
    pkg = import_package(package)
    model, loss_fn = pkg.full_model(0), pkg.criterion()
    data = SyntheticBatches(pkg, ["input0"], batch_size, seed=0)
    make = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
    optim = make(model.parameters(), **opt)
    for step in range(steps):
        for x, y, share in _micro(data, step, microbatches):
            (loss_fn(model(x), y) * share).backward()
        optim.step()
        optim.zero_grad()
    return model  # type: ignore[no-any-return]


def _forward_versions(replicas: Sequence[int], microbatches: int, steps: int) -> list[dict[int, int]]:
    """Per stage, the weight version (its steps taken) each unit's forward saw under pipedream."""
    out = []
    lists = build("pipedream", pipeline(replicas), microbatches, steps)
    for ranks in pipeline(replicas):
        seen = {}
        for actions in (lists[r] for r in ranks):
            taken = 0
            for a in actions:
                if a.kind == "S":
                    taken += 1
                elif a.kind == "F":
                    seen[a.index] = taken
        out.append(seen)
    return out


def pipedream_reference(
    package: Path, replicas: Sequence[int], steps: int, microbatches: int, batch_size: int, lr: float
) -> tuple[list[dict[str, torch.Tensor]], list[dict[int, int]]]:
    """PipeDream's semantics replayed in one process: each unit runs every stage on the weight version
    that stage had at the unit's forward (and its backward uses those same weights); a stage of r
    replicas steps once per round of r minibatches, with the mean of their gradients, applied to its
    newest weights (plain SGD). Returns final weights and the versions."""
    pkg = import_package(package)
    full, loss_fn = pkg.full_model(0), pkg.criterion()
    data = SyntheticBatches(pkg, ["input0"], batch_size, seed=0)
    versions = _forward_versions(replicas, microbatches, steps)
    weights = [[{n: p.detach().clone() for n, p in s.named_parameters()}] for s in full.stages]
    zero = [{n: torch.zeros_like(t) for n, t in w[-1].items()} for w in weights]
    grads, ran = [dict(z) for z in zero], [0] * len(replicas)
    for step in range(steps):
        for j, (x, y, share) in enumerate(_micro(data, step, microbatches)):
            unit, h = step * microbatches + j, x
            used = [
                {n: t.clone().requires_grad_() for n, t in weights[k][versions[k][unit]].items()}
                for k in range(len(replicas))
            ]
            for k in range(len(replicas)):
                h = torch.func.functional_call(full.stages[k], used[k], (h,))
            (loss_fn(h, y) * share).backward()
            for k in range(len(replicas)):
                for n, t in used[k].items():
                    grads[k][n] = grads[k][n] + t.grad
        for k, r in enumerate(replicas):
            ran[k] += 1
            if ran[k] == r or step == steps - 1:
                weights[k].append({n: t - lr * grads[k][n] / ran[k] for n, t in weights[k][-1].items()})
                grads[k], ran[k] = dict(zero[k]), 0
    return [w[-1] for w in weights], versions
