"""Deferred initialisation: any tensor of a model built without its large tensors, bit for bit as
``torch.manual_seed(seed); factory()`` makes it, and the memory that costs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest
import torch
from torch import nn

from runtime.building import deferred_init
from runtime.building.deferred_init import build_deferred, is_deferred


class Odd(nn.Module):
    """Every way of making a weight we know of: module inits, value-reading inits (trunc_normal_'s
    rejection loop, orthogonal_'s QR), writes through views, copies, ties, buffers, casts."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 12, padding_idx=0)
        self.lstm = nn.LSTM(12, 12)
        self.mha = nn.MultiheadAttention(12, 3)
        layer = nn.TransformerEncoderLayer(12, 3, 24)
        self.stack = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.ortho = nn.Linear(12, 12)
        nn.init.orthogonal_(self.ortho.weight)
        self.trunc = nn.Parameter(torch.empty(30, 12))
        nn.init.trunc_normal_(self.trunc, std=0.5, a=-0.4, b=0.4)
        self.sparse = nn.Parameter(torch.empty(20, 12))
        nn.init.sparse_(self.sparse, 0.5)
        self.conv = nn.Conv2d(4, 4, 3)
        nn.init.dirac_(self.conv.weight)
        self.register_buffer("mask", torch.tril(torch.ones(16, 16)))
        self.register_buffer("noise", torch.randn(8, 8) / 10, persistent=False)
        self.head = nn.Linear(12, 50, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.randn(12, 12) * 0.02 + 1)
        with torch.no_grad():
            self.ortho.bias.copy_(torch.arange(12.0))
            self.ortho.weight[0].zero_()
        self.other = nn.Linear(12, 12)
        self.other.weight.data = self.ortho.weight.data.clone() * 2
        if float(self.scale.detach().abs().max()) > 10:  # a value read while building
            raise AssertionError


def _odd_bf16() -> nn.Module:
    return Odd().to(torch.bfloat16)


def _reference(factory: Callable[[], nn.Module], seed: int) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory()
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}


def _assert_exact(factory: Callable[[], nn.Module], seed: int = 3) -> int:
    built = build_deferred(factory, seed)
    named = [*built.module.named_parameters(remove_duplicate=False), *built.module.named_buffers()]
    values = built.materialise([t for _, t in named])
    want = _reference(factory, seed)
    for (name, _), value in zip(named, values, strict=True):
        assert value.dtype == want[name].dtype, name
        assert torch.equal(value, want[name]), name
    return sum(is_deferred(t) for _, t in named)


@pytest.mark.parametrize("factory", [Odd, _odd_bf16], ids=["fp32", "bf16"])
def test_every_tensor_deferred_replays_exactly(monkeypatch: pytest.MonkeyPatch, factory: type) -> None:
    monkeypatch.setattr(deferred_init, "LARGE", 1)  # defer everything: every path is exercised
    deferred = _assert_exact(factory)
    assert deferred >= 25


def test_small_tensors_stay_real_large_ones_are_deferred() -> None:
    built = build_deferred(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(256, 256)))
    assert not is_deferred(built.module[0].weight) and not is_deferred(built.module[1].bias)
    assert is_deferred(built.module[1].weight)
    assert isinstance(built.module[1].weight, nn.Parameter)
    assert built.module[1].weight.device.type == "cpu"  # inits see a CPU tensor, not a meta one
    _assert_exact(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(256, 256)))


def test_the_callers_generator_is_untouched() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    built = build_deferred(Odd, 0)
    built.materialise([built.module.ortho.weight])
    assert torch.equal(torch.get_rng_state(), before)


def test_a_hugging_face_model_replays_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from runtime.building.hugging_face import factory

    monkeypatch.setattr(deferred_init, "LARGE", 1)
    assert _assert_exact(factory("hf:llama")) > 30


def test_a_deferred_tensor_refuses_work_outside_the_build() -> None:
    built = build_deferred(lambda: nn.Linear(256, 256))
    with pytest.raises(RuntimeError, match="materialise it first"):
        built.module.weight.sum()


@pytest.mark.slow
def test_one_layer_costs_one_layer_of_memory() -> None:
    """32 layers of 16 MiB: building the model deferred and materialising one layer stays far below
    the model's 512 MiB (one scratch tensor for the random draws, one layer kept)."""
    layers, width = 32, 2048
    code = textwrap.dedent(
        f"""
        import torch
        from torch import nn
        from runtime.building.deferred_init import build_deferred
        from runtime.observing.resident_memory import peak_resident_bytes, reset_peak, resident_bytes

        torch.set_num_threads(1)
        reset_peak()
        before = resident_bytes()
        built = build_deferred(lambda: nn.Sequential(*(nn.Linear({width}, {width}) for _ in range({layers}))))
        layer = built.materialise([built.module[7].weight])[0]
        print(layer.numel(), (peak_resident_bytes() - before) // 1024)
        """
    )
    hop = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {code!r}]))"
    result = subprocess.run([sys.executable, "-c", hop], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    numel, grown_kib = map(int, result.stdout.split())
    assert numel == width * width
    model_kib = layers * width * width * 4 // 1024
    assert grown_kib < model_kib / 8, f"grew {grown_kib / 1024:.0f} MiB, the model is {model_kib / 1024:.0f}"
