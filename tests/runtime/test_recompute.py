"""A recomputing stage trains exactly as a stage that keeps its activations, dropout included."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from runtime.executing.recompute import run_forward
from runtime.packages.load import import_package
from tests.runtime.helpers import run, stage_state
from tests.runtime.packages import write_package

torch.set_num_threads(1)

_DROPOUT = "torch.nn.functional.dropout(torch.tanh(self.fc(x)), 0.5, self.training)"


def _package(folder: Path, schedule: str, recompute: bool) -> Path:
    """Two stages, both with dropout (its masks must be drawn again identically in recomputation)."""
    pkg = write_package(folder, "chain", replicas=(1, 1), schedule=schedule, microbatches=4, batch_size=8)
    for k in (0, 1):
        source = (pkg / f"stage{k}.py").read_text()
        body = source.rsplit("return ", 1)[1].strip()
        (pkg / f"stage{k}.py").write_text(
            source.replace(body, _DROPOUT.replace("torch.tanh(self.fc(x))", body))
        )
    plan = json.loads((pkg / "plan.json").read_text())
    for stage in plan["stages"]:
        stage["recompute"] = recompute
    (pkg / "plan.json").write_text(json.dumps(plan))
    return pkg


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_recompute_gives_the_gradients_of_keeping_activations(tmp_path: Path, schedule: str) -> None:
    """lr 1 and plain SGD: each step moves the weights by exactly the gradient, so equal weights after
    two steps are equal gradients (pipedream: on the stashed weights the forward used)."""
    states, losses = [], []
    for recompute in (False, True):
        pkg = _package(tmp_path / f"pkg-{recompute}", schedule, recompute)
        ckpt = tmp_path / f"ckpt-{recompute}"
        metrics = run(pkg, steps=2, schedule=schedule, lr=1.0, checkpoint_dir=str(ckpt))
        states.append([stage_state(ckpt, 2, k) for k in (0, 1)])
        losses.append(metrics["losses"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for kept, again in zip(*states, strict=True):
        for name, value in kept.items():
            torch.testing.assert_close(again[name], value, rtol=0, atol=1e-6)
    start = import_package(tmp_path / "pkg-False").full_model(0).stages[0].fc.weight.detach()
    assert (states[0][0]["fc.weight"] - start).abs().max() > 1e-3  # the gradients compared are not zero


def test_run_forward_keeps_only_inputs_and_replays_dropout() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 8))
    x = torch.randn(4, 8, requires_grad=True)
    grads, kept = [], []
    for recompute in (False, True):
        torch.manual_seed(1)
        saved: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(_counting(saved), lambda t: t):
            out = run_forward(layer, (x,), recompute)
        grads.append(torch.autograd.grad(out.square().sum(), [x, *layer.parameters()]))
        kept.append(saved)
    assert kept[1] == [x.numel()] and sum(kept[0]) > 64 * 4  # recomputing: autograd keeps the input only
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _counting(saved: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    return pack
