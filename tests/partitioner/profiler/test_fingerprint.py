"""Identical layers share one measurement; anything that changes the cost tells them apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import fx, nn

from partitioner.profiler.fingerprint import fingerprint
from partitioner.profiler.profile import profile_model

torch.set_num_threads(1)

MODEL = f"{Path(__file__).with_name('blocks_model.py')}:four"
ONE_WIDE = MODEL.replace(":four", ":four_one_wide")


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


@pytest.mark.parametrize("materialize", ["whole", "layer"])
def test_a_block_that_differs_is_measured_and_the_others_share_one_measurement(materialize: str) -> None:
    """Blocks 0, 1 and 3 are twins; block 2's wider hidden layer is measured on its own (its norm
    and residual add, the same shapes as the others', are twins), whole or layer by layer."""
    profile = profile_model(ONE_WIDE, 2, device="cpu", repeats=1, fixed_cost=False, materialize=materialize)
    reused = profile.extra["layers_measured"]["reused"]
    assert {"blocks_2_up", "relu_2", "blocks_2_down"}.isdisjoint(reused)
    assert {f"blocks_{i}_{op}" for i in (1, 3) for op in ("norm", "up", "down")} | {"blocks_2_norm"} <= set(
        reused
    )
    nodes = {n.id: n for n in profile.nodes}
    assert nodes["blocks_2_up"].param_bytes == 2 * nodes["blocks_0_up"].param_bytes
    for twin, source in reused.items():
        assert (nodes[twin].forward_ms, nodes[twin].backward_ms) == (
            nodes[source].forward_ms,
            nodes[source].backward_ms,
        )


@pytest.mark.parametrize(("materialize", "model"), [("whole", None), ("layer", None), ("auto", "h100")])
def test_a_reused_layer_counts_what_it_saves_as_if_measured(materialize: str, model: str | None) -> None:
    """A pool reads the tensor the ReLU before it saved, so it must not count it again, also where that
    ReLU is a twin and never measured (vgg16 counted a third more saved bytes than it keeps, and
    ``partition`` over-predicted its first stage's memory by 12%). Measured, layer by layer and
    estimated: the same bytes with and without reuse."""
    spec = f"{Path(__file__).with_name('pooled_model.py')}:pooled"
    options = {"device": "cpu", "repeats": 1, "fixed_cost": False, "materialize": materialize}
    if model:
        options["device_model"] = model
    reused = profile_model(spec, 4, **options)  # type: ignore[arg-type]
    every = profile_model(spec, 4, reuse=False, **options)  # type: ignore[arg-type]
    assert {"features_3", "features_8"} <= set(reused.extra["layers_measured"]["reused"])
    assert [(n.id, n.saved_bytes) for n in reused.nodes] == [(n.id, n.saved_bytes) for n in every.nodes]
    pool = {n.id: n for n in reused.nodes}["features_4"]
    assert pool.saved_bytes < pool.output_bytes * 3  # its indices (int64), not its input again
