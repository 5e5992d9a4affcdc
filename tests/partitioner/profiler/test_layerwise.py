"""Layer by layer: the same profile as the model measured whole, one layer's weights real at a time."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import Tensor

from partitioner.graph import Profile
from partitioner.models.specs import load_model
from partitioner.profiler import budget
from partitioner.profiler.fake import trace_weightless
from partitioner.profiler.layerwise import LayerwiseProfiler, Weights
from partitioner.profiler.profile import profile_model

torch.set_num_threads(1)

BLOCKS = f"{Path(__file__).with_name('blocks_model.py')}:four"


def _structure(profile: Profile) -> list[tuple[str, str, int, int, int]]:
    return [(n.id, n.target, n.param_bytes, n.output_bytes, n.saved_bytes) for n in profile.nodes]


@pytest.mark.parametrize(("spec", "shape"), [(BLOCKS, None), ("tiny-gpt", (12,)), ("hf:llama", (8,))])
def test_layer_by_layer_profiles_the_graph_the_whole_model_gives(
    spec: str, shape: tuple[int, ...] | None
) -> None:
    """Node ids, weights, outputs and saved bytes agree with the model measured whole (every layer
    measured); no whole-step time, so no fidelity."""
    options = {"device": "cpu", "repeats": 1, "fixed_cost": False, "reuse": False}
    whole = profile_model(spec, 2, shape, materialize="whole", **options)  # type: ignore[arg-type]
    layers = profile_model(spec, 2, shape, materialize="layer", **options)  # type: ignore[arg-type]
    if whole.tracer == "fx":
        assert _structure(layers) == _structure(whole)
    else:  # exported at static shapes: no shape nodes, else the same layers
        weights = [
            [(n.name, n.param_bytes, n.saved_bytes) for n in p.nodes if n.param_bytes]
            for p in (layers, whole)
        ]
        assert weights[0] == weights[1] and weights[0]
    assert layers.extra["materialized"] == "layer" and whole.extra["materialized"] == "whole"
    assert layers.step_ms is None and layers.fidelity is None
    assert all(n.forward_ms > 0 for n in layers.layers if n.param_bytes)
    assert layers.tied == whole.tied
    static = {"static_shapes": layers.tracer == "export"}  # exported at the profiled shapes: faster
    assert layers.tracer_options == {**whole.tracer_options, **static}


class _Counting(Weights):
    """Weights that remember the most parameter bytes real at once."""

    real_now = most = 0

    @contextmanager
    def real(self, paths: Mapping[str, Tensor]) -> Iterator[list[Tensor]]:
        with super().real(paths) as made:
            size = sum(t.numel() * t.element_size() for t in made)
            type(self).real_now += size
            type(self).most = max(type(self).most, type(self).real_now)
            try:
                yield made
            finally:
                type(self).real_now -= size


def test_one_layers_weights_are_real_at_a_time() -> None:
    bundle = load_model(BLOCKS, 2, lazy=True)
    traced = trace_weightless(bundle, torch.device("cpu"))
    gm = traced.graph_module
    profiler = LayerwiseProfiler(
        gm, traced.groups, _Counting(gm, bundle.buffers, torch.device("cpu")), repeats=1
    )
    costs = profiler.profile(*bundle.inputs)
    largest = max(p.numel() * 4 for p in bundle.module.parameters())
    assert 0 < _Counting.most <= largest + 4 * 128  # the largest layer's weights (and its bias)
    assert {t.device.type for t in gm.parameters()} == {"meta"}  # all gone back
    assert set(costs) == {g.id for g in traced.groups}
    assert profiler.twins  # the 3 later blocks reused block 0 and did not run


def test_auto_chooses_from_the_weights_against_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(BLOCKS, 2, lazy=True).module
    weights = sum(p.numel() * 4 for p in model.parameters())
    cpu = torch.device("cpu")
    monkeypatch.setattr(budget, "free_bytes", lambda device: 8.0 * weights)
    assert budget.choose_materialize("auto", model, cpu) == "whole"
    monkeypatch.setattr(budget, "free_bytes", lambda device: 8.0 * weights - 1)
    assert budget.choose_materialize("auto", model, cpu) == "layer"
    assert budget.choose_materialize("whole", model, cpu) == "whole"
    with pytest.raises(budget.PipeplanError, match="unknown --materialize"):
        budget.choose_materialize("lazy", model, cpu)
    assert budget.free_bytes(cpu) > 0


def test_auto_profiles_many_identical_blocks_layer_by_layer_unless_fixed_costs_are_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whole mode's tracing and step grow with the depth; a fixed time per call needs whole mode."""
    monkeypatch.setattr(budget, "free_bytes", lambda device: 2.0**40)  # the weights fit: size decides nothing
    cpu, eight = torch.device("cpu"), load_model(BLOCKS.replace(":four", ":eight"), 2, lazy=True).module
    four = load_model(BLOCKS, 2, lazy=True).module
    assert (budget.repeated_blocks(eight), budget.repeated_blocks(four)) == (8, 4)
    assert budget.choose_materialize("auto", eight, cpu) == "layer"
    assert budget.choose_materialize("auto", eight, cpu, fixed_cost=True) == "whole"
    assert budget.choose_materialize("auto", four, cpu) == "whole"
    assert budget.choose_materialize("whole", eight, cpu) == "whole"
    spec = BLOCKS.replace(":four", ":eight")
    options = {"device": "cpu", "repeats": 1}
    assert profile_model(spec, 1, **options).extra["materialized"] == "layer"  # type: ignore[arg-type]
    assert profile_model(spec, 2, **options).extra["materialized"] == "whole"  # type: ignore[arg-type]


def test_partition_writes_no_stage_code_for_a_model_it_cannot_build(monkeypatch: pytest.MonkeyPatch) -> None:
    profile = Profile(nodes=(), model="big", dtype="bfloat16")
    assert budget.unbuildable(profile) is None  # no weights: builds anywhere
    from dataclasses import replace

    from partitioner.graph import Node

    weights = (Node("w", "w", "call_module", "Linear", param_bytes=2 * 2**30),)
    heavy = replace(profile, nodes=weights, tracer_options={"spec": "big.py:build"})
    monkeypatch.setattr(budget, "free_bytes", lambda device: 7.9 * 2**30)
    assert "builds big whole in float32 (4.0 GiB of weights)" in str(budget.unbuildable(heavy))
    # models built on meta (fx: built-in, torchvision, hf:) or traced without weights (export) build anywhere
    assert budget.unbuildable(replace(heavy, tracer="export")) is None
    assert budget.unbuildable(replace(heavy, tracer_options={"spec": "hf:big.json"})) is None
    monkeypatch.setattr(budget, "free_bytes", lambda device: 8.0 * 2**30)
    assert budget.unbuildable(heavy) is None
