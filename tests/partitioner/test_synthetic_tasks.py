"""Synthetic data is a task for every head, the one a package draws and the one the profile measured.

For each head kind of ``hf:`` (causal-lm, masked-lm, seq2seq, speech-seq2seq, seq-cls, image-cls):
no scored target can be read off the model's inputs at its own position (masked positions hold the mask
token, decoder inputs are the labels shifted right, classes are drawn apart from the inputs), and a few
optimizer steps on those minibatches lower the loss of the model's own head. Then a generated package
draws, for seed 0, exactly the inputs and targets the profile measured.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from partitioner.models.specs import load_model
from runtime.building.stage_init import MASK_RATE, synthetic_example

pytest.importorskip("transformers")
torch.set_num_threads(1)

# head kind -> a tiny family with that head
HEADS = {
    "causal-lm": "hf:llama",
    "masked-lm": "hf:bert",
    "seq2seq": "hf:bart",
    "speech-seq2seq": "hf:whisper",
    "seq-cls": "hf:bert:seq-cls",
    "image-cls": "hf:vit",
}


def _scored(targets: torch.Tensor) -> torch.Tensor:
    return targets != -100


def _no_copy(head: str, inputs: dict[str, torch.Tensor], targets: torch.Tensor, mask_token: int) -> None:
    """No input holds a scored target at the target's own position (beyond a random draw's chance)."""
    if head == "masked-lm":
        ids, scored = inputs["input_ids"], _scored(targets)
        assert bool((ids[scored] == mask_token).all()), "a scored position shows its token"
        assert bool((targets[~scored] == -100).all()) and scored.float().mean() < 3 * MASK_RATE
        assert bool(scored.any(1).all()), "every row scores a position"
    if head in ("seq2seq", "speech-seq2seq"):
        decoder = inputs["decoder_input_ids"]
        assert torch.equal(decoder[:, 1:], targets[:, :-1]), "decoder inputs are the labels shifted right"
    for name, value in inputs.items():
        if value.shape == targets.shape and not value.is_floating_point():
            same = (value == targets)[_scored(targets)].float().mean()
            assert same < 0.1, f"{name} equals the targets at {same:.0%} of the scored positions"


@pytest.mark.parametrize("head", list(HEADS))
def test_each_head_learns_a_task_it_cannot_copy(head: str) -> None:
    bundle = load_model(HEADS[head], batch_size=4)
    assert bundle.data is not None
    specs, target = bundle.data
    minibatches = [synthetic_example(specs, target, 4, seed) for seed in range(2)]
    for values, targets in minibatches:
        inputs = dict(zip(bundle.input_names, values, strict=True))
        _no_copy(head, inputs, targets, int(target.get("mask_token", -1)))
    model = bundle.module.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    def loss_of(values: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        return bundle.loss_fn(bundle.call(model, tuple(values)), targets)

    first = float(sum(loss_of(*m) for m in minibatches).detach())
    for _ in range(6):
        for m in minibatches:
            optimizer.zero_grad()
            loss_of(*m).backward()
            optimizer.step()
    last = float(sum(loss_of(*m) for m in minibatches).detach())
    assert last < 0.9 * first, f"{head}: loss {first:.3f} -> {last:.3f}"


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param("hf:bert", marks=pytest.mark.slow),
        pytest.param("hf:bart", marks=pytest.mark.slow),
        "tiny-cnn",
    ],
)
def test_a_package_draws_the_data_the_profile_measured(spec: str, tmp_path: Path) -> None:
    from partitioner.generation.codegen import write_package
    from partitioner.verification.verify import load_package
    from tests.partitioner.codegen_support import plan_for, profile_for

    profile = profile_for(spec)
    write_package(profile, plan_for(profile, [len(profile.nodes) // 2]), tmp_path / "pkg")
    package, _, _ = load_package(tmp_path / "pkg")
    bundle = load_model(spec, batch_size=profile.batch_size or 2)
    for got, want in zip(package.example_inputs(bundle.batch_size).values(), bundle.inputs, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(package.example_targets(bundle.batch_size), bundle.targets)
    other = package.example_inputs(bundle.batch_size, seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(other.values(), bundle.inputs, strict=True))
