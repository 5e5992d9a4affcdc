"""A split whose traced code carries a head count as a constant is found before any rank starts: a
toy attention reshaping to 4 heads fails at degree 2 and is kept whole, one reshaping to ``-1``
heads is kept split; an MLP breaking only above degree 2 keeps ``tp_max`` 2; Gemma2's eager
attention (``repeat_kv`` to the whole model's heads) is kept whole and its MLP split."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from partitioner.profiler.tensor_check import checked
from partitioner.profiler.tensor_plan import TensorLayer


class _Attention(nn.Module):
    """Query and value projections read as ``heads`` heads of 8 (``None``: ``-1`` heads), then o."""

    def __init__(self, heads: int | None) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(32, 32, bias=False)
        self.v = nn.Linear(32, 32, bias=False)
        self.o = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        q = self.q(x).view(b, s, self.heads or -1, 8).transpose(1, 2)
        v = self.v(x).view(b, s, self.heads or -1, 8).transpose(1, 2)
        a = (q @ q.transpose(2, 3)).softmax(-1) @ v
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


class _Model(nn.Module):
    def __init__(self, heads: int | None) -> None:
        super().__init__()
        self.attn = _Attention(heads)
        self.up = nn.Linear(32, 12)
        self.down = nn.Linear(12, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(x)
        u = self.up(h)  # (a rank's 12 / t features as 2 rows: breaks at t = 4, 3 features)
        return h + self.down(u.view(u.size(0), u.size(1), 2, -1).flatten(2))


_ATTN = TensorLayer(
    "attn", 4, {"attn.q.weight": "colwise", "attn.v.weight": "colwise", "attn.o.weight": "rowwise"}
)
_MLP = TensorLayer("up", 4, {"up.weight": "colwise", "up.bias": "colwise", "down.weight": "rowwise"})


@pytest.mark.parametrize("heads", [4, None])
def test_constant_heads_keep_the_attention_whole(heads: int | None) -> None:
    gm = fx.symbolic_trace(_Model(heads))
    kept, whole = checked(gm, (torch.randn(2, 5, 32),), [_ATTN, _MLP])
    names = {lay.name: lay.tp_max for lay in kept}
    if heads is None:
        assert names == {"attn": 4, "up": 2} and not whole
    else:
        assert names == {"up": 2} and list(whole) == ["attn"] and whole["attn"].startswith("at degree 2: ")
    assert gm.attn.q.weight.shape == (32, 32) and gm.up.bias.shape == (12,)  # (put back)


def test_nothing_is_checked_without_a_graph() -> None:
    assert checked(None, (), [_ATTN]) == ((_ATTN,), {})


def test_gemma2_attention_kept_whole_and_its_mlp_split() -> None:
    pytest.importorskip("transformers")
    from partitioner.models.specs import load_model
    from partitioner.profiler.tensor_check import derive_checked
    from partitioner.profiler.trace import trace_model

    bundle = load_model("hf:gemma2", 2, None)
    kept, whole = derive_checked(trace_model(bundle).graph_module, bundle.module, bundle.inputs)
    assert sorted(whole) == [f"model.layers.{i}.self_attn" for i in range(4)]
    assert sorted(lay.name for lay in kept) == [f"model.layers.{i}.mlp" for i in range(4)]
