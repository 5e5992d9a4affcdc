"""Identical layers share one measurement; anything that changes the cost tells them apart."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import fx, nn

from partitioner.profiler import profile_model
from partitioner.profiler.fingerprint import fingerprint

torch.set_num_threads(1)

MODEL = f"{Path(__file__).with_name('blocks_model.py')}:four"


def _print(module: nn.Module, x: torch.Tensor, grad: bool = False) -> str:
    gm = fx.symbolic_trace(module)
    members = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    (placeholder,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return fingerprint(gm, members, {placeholder: x}, {placeholder.name} if grad else set())


def test_the_fingerprint_sees_code_shapes_dtypes_and_gradients_but_not_names() -> None:
    a, b = nn.Linear(4, 8), nn.Linear(4, 8)
    x = torch.randn(2, 4)
    assert _print(a, x) == _print(b, x)  # another module with the same shapes: a twin
    assert _print(a, x) != _print(nn.Linear(4, 9), x)  # a parameter's shape
    assert _print(a, x) != _print(nn.Linear(4, 8, bias=False), x)  # its tensors
    assert _print(a, x) != _print(a, torch.randn(3, 4))  # an input's shape
    assert _print(a, x) != _print(a, x.double())  # an input's dtype
    assert _print(a, x) != _print(a, x, grad=True)  # whether the input gets a gradient
    assert _print(a, x) != _print(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), x)  # the code


def test_identical_blocks_are_measured_once_and_share_the_measurement() -> None:
    profile = profile_model(MODEL, 4, device="cpu", repeats=1, fixed_cost=False)
    measured = profile.extra["layers_measured"]
    assert measured["layers"] == len(profile.layers)
    # each block is 6 nodes (norm, up, relu, down, add: the fx layers); blocks 1-3 reuse block 0
    reused = measured["reused"]
    assert measured["distinct"] == measured["layers"] - len(reused) and len(reused) == 3 * 5
    nodes = {n.id: n for n in profile.nodes}
    for twin, source in reused.items():
        a, b = nodes[twin], nodes[source]
        assert (a.forward_ms, a.backward_ms, a.saved_bytes, a.output_bytes) == (
            b.forward_ms, b.backward_ms, b.saved_bytes, b.output_bytes,
        )  # fmt: skip
        assert a.target == b.target and a.param_bytes == b.param_bytes
    every = profile_model(MODEL, 4, device="cpu", repeats=1, fixed_cost=False, reuse=False)
    assert every.extra["layers_measured"]["reused"] == {}
    assert [(n.id, n.saved_bytes, n.output_bytes) for n in every.nodes] == [
        (n.id, n.saved_bytes, n.output_bytes) for n in profile.nodes
    ]
