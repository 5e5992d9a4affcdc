"""_stagekit (copied into every package): exact, per-module and checkpoint initialisation, stage-only
materialisation, tied weights."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from runtime.building.stage_init import Original, build_meta, derive_seed, exact_model, full_model, populate


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


def test_exact_stage_is_the_original_models_slice() -> None:
    """init="exact": a stage holds what ``torch.manual_seed(seed); factory()`` holds, ties and
    constructor-made values included, though no process built the whole model."""
    model = exact_model(Tied, seed=5)
    stage = nn.Module()
    populate(stage, Tied, ["head", "body.1"], ["scale", "mask"], seed=5, init="exact")
    for name, tensor in [*stage.named_parameters(), *stage.named_buffers()]:
        want = model.get_parameter(name) if "mask" not in name else model.mask
        assert torch.equal(tensor, want), name
    assert full_model(Tied, seed=5, init="exact").head.weight.equal(model.emb.weight)


def _sharded(tmp_path: Path, state: dict[str, torch.Tensor]) -> Path:
    """``state`` written as save_pretrained writes a sharded checkpoint: two files and an index."""
    from safetensors.torch import save_file

    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, inside in shards.items():
        save_file({n: state[n].contiguous() for n in inside}, str(tmp_path / file))
    weight_map = {n: file for file, inside in shards.items() for n in inside}
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path


def test_stage_reads_its_tensors_from_a_sharded_safetensors_folder(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    trained = full_model(Tied, seed=9)
    state = {n: t.detach() for n, t in trained.state_dict().items() if n != "head.weight"}  # tied: kept once
    folder = _sharded(tmp_path, state)
    stage = nn.Module()
    populate(stage, Tied, ["head", "body.0"], ["scale"], seed=0, weights=str(folder))
    assert torch.equal(stage.head.weight, trained.emb.weight)  # found under the tie's other name
    assert torch.equal(stage.get_submodule("body.0").weight, trained.body[0].weight)
    assert torch.equal(stage.scale, trained.scale)
    assert full_model(Tied, weights=str(folder)).body[1].bias.equal(trained.body[1].bias)
    del state["body.0.bias"]
    with pytest.raises(KeyError, match=r"lack body\.0\.bias"):
        populate(nn.Module(), Tied, ["body.0"], [], weights=str(_sharded(tmp_path, state)))


def test_original_values_leave_the_model_unmaterialised() -> None:
    """Verify asks the original model for one tensor at a time: it gets the value, the model keeps none."""
    original = Original(Tied, seed=3)
    value = original.values(["body.0.weight"])["body.0.weight"]
    assert torch.equal(value, full_model(Tied, seed=3).body[0].weight)
    assert original.tensor("body.0.weight").device.type == "meta"


def _grown_kib(code: str) -> tuple[int, int]:
    """Run ``code`` (which prints a number and its peak RSS in KiB) in a fresh process; Linux keeps the
    parent's peak RSS in a child's ru_maxrss across fork+exec, and pytest may be big by now, so the
    code runs in a grandchild forked from a small Python process."""
    hop = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {code!r}]))"
    result = subprocess.run([sys.executable, "-c", hop], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    first, second = map(int, result.stdout.split())
    return first, second


@pytest.mark.parametrize("init", ["seeded", "exact"])
def test_stage_does_not_materialise_the_rest_of_the_model(init: str) -> None:
    """A stage of one 16 MiB layer of a 512 MiB model: seeded or exact, it costs about one layer."""
    code = textwrap.dedent(
        f"""
        import resource, torch
        from torch import nn
        from runtime.building.stage_init import populate

        def rss_kib():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * resource.getpagesize() // 1024

        def big():
            return nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(32)))

        torch.set_num_threads(1)
        before = rss_kib()
        stage = nn.Module()
        populate(stage, big, ["5"], [], seed=0, init="{init}")
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(sum(p.numel() for p in stage.parameters()), grown)
        """
    )
    params, grown_kib = _grown_kib(code)
    assert params == 2048 * 2048 + 2048
    assert grown_kib < 96 * 1024, f"grew {grown_kib / 1024:.0f} MiB for a 16 MiB stage of a 512 MiB model"
