"""Forward-only evaluation: when it runs, how it scores, and that the pipeline's held-out loss is the
unsplit model's on the same weights and data, whichever stage is replicated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.datasets.minibatches import SyntheticBatches
from runtime.executing.evaluate import class_hits, eval_steps, segments
from runtime.packages.load import import_package, read_wiring
from tests.runtime.generated import generate
from tests.runtime.helpers import run, stage_state

torch.set_num_threads(1)


def test_eval_steps_are_multiples_of_every_and_the_end() -> None:
    assert eval_steps(0, 10, 4) == (4, 8, 10)
    assert eval_steps(0, 8, 4) == (4, 8)
    assert eval_steps(5, 10, 4) == (8, 10)  # resumed after step 5
    assert eval_steps(0, 10, 0) == (10,)
    assert eval_steps(10, 10, 4) == ()


def test_segments_cut_at_every_boundary_inside_the_run() -> None:
    assert segments(0, 10, [4, 8, 10]) == [(0, 4), (4, 4), (8, 2)]
    assert segments(3, 10, [2, 6, 6, 12]) == [(3, 3), (6, 4)]
    assert segments(0, 5, []) == [(0, 5)]


def test_class_hits_count_argmax_and_skip_ignored_targets() -> None:
    logits = torch.tensor([[[0.1, 0.9], [0.8, 0.2]], [[0.3, 0.7], [0.6, 0.4]]])
    assert class_hits(logits, torch.tensor([[1, 1], [-100, 0]])) == (2, 3)
    assert class_hits(logits[:, 0], torch.tensor([1, 0])) == (1, 2)
    assert class_hits(logits, torch.randn(2, 2)) is None  # regression targets
    assert class_hits(logits, torch.tensor([1, 0])) is None  # not one class per output row


def _reference(pkg_dir: Path, ckpt: Path, step: int, stages: int, batch: int) -> tuple[float, float]:
    """The unsplit model with the run's weights after ``step``: mean loss and accuracy over the same
    held-out minibatches (synthetic, seed 1)."""
    pkg = import_package(pkg_dir)
    model, loss_fn = pkg.full_model(0), pkg.criterion()
    weights = {name: t for k in range(stages) for name, t in stage_state(ckpt, step, k).items()}
    assert set(weights) == set(model.state_dict())
    model.load_state_dict(weights)
    model.eval()
    data = SyntheticBatches(pkg, read_wiring(pkg, stages).stage_inputs[0], batch, seed=1)
    losses, correct, total = [], 0, 0
    with torch.no_grad():
        for b in range(data.steps_per_epoch):
            out, y = model(*data.inputs(b)), data.targets(b)
            losses.append(float(loss_fn(out, y)))
            correct, total = correct + int((out.argmax(-1) == y).sum()), total + y.numel()
    return sum(losses) / len(losses), correct / total


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "replicas"), [("pipedream", (1, 2)), ("1f1b", (2, 1))])
def test_eval_loss_equals_the_unsplit_models(
    tmp_path: Path, schedule: str, replicas: tuple[int, int]
) -> None:
    batch = 8
    pkg = generate(tmp_path / "pkg", "tiny-mlp", replicas, schedule, microbatches=2, batch_size=batch)
    ckpt = tmp_path / "ckpt"
    metrics = run(
        pkg,
        steps=3,
        lr=0.2,
        checkpoint_dir=str(ckpt),
        checkpoint_every=2,
        eval_data="synthetic",
        eval_every=2,
    )
    assert [e["step"] for e in metrics["eval"]] == [2, 3]
    assert all(e["samples"] == 8 * batch for e in metrics["eval"])
    for entry in metrics["eval"]:
        loss, accuracy = _reference(pkg, ckpt, entry["step"], len(replicas), batch)
        assert entry["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-5)
        assert entry["accuracy"] == pytest.approx(accuracy)
    assert metrics["eval"][0]["loss"] != metrics["eval"][1]["loss"]  # the weights moved in between
