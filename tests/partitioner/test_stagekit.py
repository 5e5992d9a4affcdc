"""_stagekit (copied into every package): per-module seeds, stage-only materialisation, tied weights."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from torch import nn

from partitioner.stagekit import build_meta, derive_seed, full_model, populate


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.randn(4))  # no reset_parameters(): its constructor's value
        self.register_buffer("mask", torch.tril(torch.ones(3, 3)))


def test_derive_seed_depends_on_seed_and_path() -> None:
    assert derive_seed(0, "a.b") == derive_seed(0, "a.b")
    assert len({derive_seed(0, "a.b"), derive_seed(1, "a.b"), derive_seed(0, "a.c")}) == 3
    assert 0 <= derive_seed(123, "x") < 2**63


def test_seeded_full_model_keeps_ties_buffers_and_constructor_values() -> None:
    model = full_model(Tied, seed=3)
    assert model.head.weight is model.emb.weight
    assert torch.equal(model.mask, torch.tril(torch.ones(3, 3)))
    assert torch.equal(full_model(Tied, seed=3).scale, model.scale)  # deterministic for a seed
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert not torch.equal(full_model(Tied, seed=4).emb.weight, model.emb.weight)


def test_stage_gets_only_its_tensors_equal_to_full_model() -> None:
    model = full_model(Tied, seed=3)
    stage = nn.Module()
    populate(stage, Tied, ["head", "body.1"], ["scale"], seed=3)
    names = sorted(n for n, _ in stage.named_parameters())
    assert names == ["body.1.bias", "body.1.weight", "head.weight", "scale"]
    for name, tensor in stage.named_parameters():
        assert torch.equal(tensor, model.get_parameter(name)), name


def test_wiring_only_under_meta_device() -> None:
    stage = nn.Module()
    with torch.device("meta"):
        populate(stage, Tied, ["body"], [], seed=0)
    assert all(p.device.type == "meta" for p in stage.parameters())
    assert isinstance(build_meta(Tied).emb.weight, nn.Parameter)


def test_seeded_stage_does_not_materialise_the_rest_of_the_model() -> None:
    """A stage next to a 4 GiB layer is built in well under 4 GiB: only its own layer becomes real."""
    code = textwrap.dedent(
        """
        import resource, torch
        from torch import nn
        from partitioner.stagekit import populate

        def big():
            return nn.Sequential(nn.Linear(8, 8), nn.Embedding(2**24, 64))

        stage = nn.Module()
        populate(stage, big, ["0"], [], seed=0)
        print(sum(p.numel() for p in stage.parameters()), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        """
    )
    # Linux keeps the parent's peak RSS in a child's ru_maxrss across fork+exec, and pytest may be big by
    # now: measure in a grandchild, forked from a small Python process.
    hop = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {code!r}]))"
    result = subprocess.run([sys.executable, "-c", hop], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    params, peak_kib = map(int, result.stdout.split())
    assert params == 72
    assert peak_kib < 1.5 * 2**20, f"peak RSS {peak_kib / 2**20:.2f} GiB"
