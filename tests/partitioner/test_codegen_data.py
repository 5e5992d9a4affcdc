"""codegen: the synthetic data a package makes train on the model's real ranges.

Targets range over the output's classes (its last dimension), not below the largest class that
happened to appear; a constant input (an attention mask) stays constant; token ids range over the
vocabulary; a model file's own ``example_inputs``/``example_targets`` are called; every seed (the
runtime's step) gives other data, seed 0 the data ``verify`` checks.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from partitioner.generation.codegen import write_package
from partitioner.verification.verify import load_package
from runtime.datasets.minibatches import SYNTHETIC_STEPS, SyntheticBatches
from tests.partitioner.codegen_support import plan_for, profile_for

_MODEL = '''
import torch
from torch import nn


class Config:
    vocab_size = 50


class Masked(nn.Module):
    """Token ids and an attention mask in, {out} out."""

    def __init__(self):
        super().__init__()
        self.config = Config()  # as a Hugging Face model has: its vocabulary is known
        self.emb = nn.Embedding(50, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, {classes})

    def forward(self, {ids}, mask):
        h = torch.tanh(self.mix(self.emb({ids}))) * mask.unsqueeze(-1).float()
        return self.head(h{pool})


def make():
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(3))
    return Masked(), (ids, torch.ones(1, 6, dtype=torch.long))
'''

_OWN_EXAMPLES = """

def example_inputs(batch_size):
    return torch.randint(0, 50, (batch_size, 6)), torch.ones(batch_size, 6, dtype=torch.long)


def example_targets(batch_size):
    return torch.randint(0, 3, (batch_size,)) + 4
"""


def _package(
    tmp_path: Path, classes: int, pool: bool, own: bool = False, batch: int = 1, ids: str = "ids"
) -> object:
    source = _MODEL.format(
        ids=ids,
        out="class scores" if pool else "a token per position",
        classes=classes,
        pool=".mean(1)" if pool else "",
    )
    path = tmp_path / "masked.py"
    path.write_text(textwrap.dedent(source) + (_OWN_EXAMPLES if own else ""))
    profile = profile_for(f"{path}:make", batch_size=batch)
    write_package(profile, plan_for(profile, [2]), tmp_path / "pkg")
    return load_package(tmp_path / "pkg")[0]


def _steps(package: object, batch: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    data = SyntheticBatches(package, ["input0", "input1"], batch, seed=0)  # type: ignore[arg-type]
    return [(dict(zip(["ids", "mask"], data.inputs(s), strict=True)), data.targets(s)) for s in range(8)]


def test_class_targets_span_the_output_classes_and_a_mask_stays_ones(tmp_path: Path) -> None:
    """Profiled at batch 1 (one class seen), the package still draws every one of the 7 classes."""
    package = _package(tmp_path, classes=7, pool=True, batch=1)
    steps = _steps(package, 64)
    targets = torch.cat([t for _, t in steps])
    assert set(targets.tolist()) == set(range(7))
    for inputs, _ in steps:
        assert torch.equal(inputs["mask"], torch.ones(64, 6, dtype=torch.long))
        assert int(inputs["ids"].max()) < 50
    assert len({tuple(x["ids"].reshape(-1).tolist()) for x, _ in steps}) == SYNTHETIC_STEPS


def test_token_ids_range_over_the_vocabulary_with_next_token_targets(tmp_path: Path) -> None:
    """A token per position: ids range over the 50 outputs (not below the largest id profiled)."""
    package = _package(tmp_path, classes=50, pool=False, batch=1)
    steps = _steps(package, 32)
    ids = torch.cat([x["ids"] for x, _ in steps])
    assert int(ids.max()) == 49 and int(ids.min()) == 0
    for inputs, targets in steps:
        assert torch.equal(targets[:, :-1], inputs["ids"][:, 1:])
        assert bool((targets[:, -1] == -100).all())


@pytest.mark.parametrize(("name", "vocabulary"), [("input_ids", 50), ("ids", None)])
def test_ids_range_over_a_known_vocabulary_else_below_the_largest_seen(
    tmp_path: Path, name: str, vocabulary: int | None
) -> None:
    """``input_ids`` of a model with ``config.vocab_size`` range over it; other integers (position ids,
    say) stay below the largest value profiled, a range the model surely accepts."""
    package = _package(tmp_path, classes=7, pool=True, ids=name)
    profiled = int(torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(3)).max())  # make()'s
    ids = torch.cat([x["ids"] for x, _ in _steps(package, 64)])
    assert int(ids.max()) == (vocabulary - 1 if vocabulary else profiled)


def test_the_model_files_own_examples_are_called(tmp_path: Path) -> None:
    package = _package(tmp_path, classes=7, pool=True, own=True)
    steps = _steps(package, 16)
    targets = torch.cat([t for _, t in steps])
    assert set(targets.tolist()) == {4, 5, 6}  # only the file's example_targets makes these
    assert len({tuple(t.tolist()) for _, t in steps}) == SYNTHETIC_STEPS
    assert all(torch.equal(x["mask"], torch.ones(16, 6, dtype=torch.long)) for x, _ in steps)
    first = package.example_inputs(16)  # type: ignore[attr-defined]
    assert torch.equal(first["input0"], package.example_inputs(16)["input0"])  # type: ignore[attr-defined]


@pytest.mark.parametrize("spec", ["tiny-cnn", "tiny-gpt"])
def test_zoo_minibatches_differ_per_step_and_seed_zero_is_profiled(tmp_path: Path, spec: str) -> None:
    """The same minibatch at every step would be learnt by heart (vgg16's loss read 0.0000 from step 5)."""
    from partitioner.models.specs import load_model

    profile = profile_for(spec)
    write_package(profile, plan_for(profile, [3]), tmp_path / "pkg")
    package = load_package(tmp_path / "pkg")[0]
    name = next(iter(package.example_inputs(4)))
    data = SyntheticBatches(package, [name], 4, seed=0)
    firsts = {tuple(data.inputs(s)[0].reshape(-1)[:8].tolist()) for s in range(SYNTHETIC_STEPS)}
    targets = {tuple(data.targets(s).reshape(-1).tolist()) for s in range(SYNTHETIC_STEPS)}
    assert len(firsts) == len(targets) == SYNTHETIC_STEPS
    bundle = load_model(spec, 4)
    torch.testing.assert_close(data.inputs(0)[0], bundle.make_inputs(4)[0])
    torch.testing.assert_close(data.targets(0), bundle.make_targets(4))
