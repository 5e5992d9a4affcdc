"""Estimates: the FLOPs and bytes torch counts on meta tensors, priced on a device model's roofline."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from partitioner.errors import PipeplanError
from partitioner.hardware.devices import PRESETS, DeviceModel, save_device_model
from partitioner.profiler.cpu_model import cpu_model
from partitioner.profiler.estimate import Work
from partitioner.profiler.profile import profile_model

torch.set_num_threads(1)

HERE = Path(__file__).parent
MLP, ATTENTION = (f"{HERE / 'estimate_model.py'}:{name}" for name in ("mlp", "attention"))


def _device(tmp_path: Path, **fields: object) -> str:
    """A device model file: 1 TFLOP/s at every dtype, no launch cost, unless told otherwise."""
    model = DeviceModel(
        "test", "a made-up device", {"float32": 1e12}, 1e30, 2**40, 1.0, 1.0, 0.0, float32_conv="float32"
    )
    return str(save_device_model(replace(model, **fields), tmp_path / "device.json"))  # type: ignore[arg-type]


def test_a_kernel_costs_the_longest_of_its_math_its_bytes_and_a_launch() -> None:
    h100, work = PRESETS["h100"], Work()
    work.add(h100, 0.0, 3.35e9 * h100.memory_efficiency, "float32")  # 1 ms of memory traffic
    assert work.seconds == pytest.approx(1e-3)
    work.add(h100, 1.0, 1.0, "bfloat16")  # a tiny product: one launch
    assert work.seconds == pytest.approx(1e-3 + h100.launch_s)
    work.add(h100, 2.0 * 8192**3, 1.0, "bfloat16")  # a large one, at the measured ceiling
    assert work.seconds == pytest.approx(1e-3 + h100.launch_s + 2.0 * 8192**3 / 777.57e12)
    assert work.kernels == 3 and work.flops == 1.0 + 2.0 * 8192**3


def test_a_linear_layer_costs_its_products(tmp_path: Path) -> None:
    """fc_a (64 -> 32, batch 8): 2 x 8 x 64 x 32 FLOPs forward and as many backward (the weight
    gradient: the model's input needs none); fc_b (32 -> 10) twice its forward backward (input and
    weight gradients); the ReLU moves bytes only: free at unbounded bandwidth."""
    profile = profile_model(MLP, 8, device_model=_device(tmp_path))
    nodes = {n.name: n for n in profile.nodes}
    a, b = 2 * 8 * 64 * 32, 2 * 8 * 32 * 10
    assert nodes["fc_a"].forward_ms == pytest.approx(a / 1e12 * 1e3)
    assert nodes["fc_a"].backward_ms == pytest.approx(a / 1e12 * 1e3)
    assert nodes["fc_b"].forward_ms == pytest.approx(b / 1e12 * 1e3)
    assert nodes["fc_b"].backward_ms == pytest.approx(2 * b / 1e12 * 1e3)
    assert nodes["act"].forward_ms == pytest.approx(0.0, abs=1e-12)
    slow_memory = profile_model(MLP, 8, device_model=_device(tmp_path, memory_bandwidth=1e9))
    relu = {n.name: n for n in slow_memory.nodes}["act"]
    assert relu.forward_ms == pytest.approx(2 * 8 * 32 * 4 / 1e9 * 1e3)  # read and write 8 x 32 floats
    assert profile.device == "test" and profile.extra["estimate"]["device_model"]["name"] == "test"
    assert profile.step_ms is None and profile.extra["materialized"] == "none"


def test_attention_is_priced_as_one_fused_kernel(tmp_path: Path) -> None:
    """Causal attention of 2 heads over 32 positions of width 8 (batch 4): QK^T and PV, half of them
    masked: 2 x 4 x 2 x 32 x 32 x (8 + 8) / 2 FLOPs forward, 2.5 times that backward; the scores
    never reach memory."""
    profile = profile_model(ATTENTION, 4, device_model=_device(tmp_path))
    (sdpa,) = [n for n in profile.nodes if "scaled_dot_product_attention" in n.name]
    flops = 2 * 4 * 2 * 32 * 32 * 16 / 2
    assert sdpa.forward_ms == pytest.approx(flops / 1e12 * 1e3)
    assert sdpa.backward_ms == pytest.approx(2.5 * flops / 1e12 * 1e3)


def test_a_bf16_estimate_computes_and_saves_as_autocast_does(tmp_path: Path) -> None:
    """Under --precision bf16 the linear layers compute in bf16 (4x the float32 rate here) and hand
    on, and save, bf16 activations: half the bytes; a float32 estimate is priced as before."""
    device = _device(tmp_path, peak_flops={"float32": 1e12, "bfloat16": 4e12})
    fp32 = {n.name: n for n in profile_model(MLP, 8, device_model=device).nodes}
    bf16 = {n.name: n for n in profile_model(MLP, 8, device_model=device, precision="bf16").nodes}
    a = 2 * 8 * 64 * 32
    assert fp32["fc_a"].forward_ms == pytest.approx(a / 1e12 * 1e3)  # unchanged
    assert bf16["fc_a"].forward_ms == pytest.approx(a / 4e12 * 1e3)  # the casts are free on this device
    for name in ("fc_a", "act"):  # fc_a saves its input as cast to bf16, the ReLU its output
        assert (bf16[name].output_bytes * 2, bf16[name].saved_bytes * 2) == (
            fp32[name].output_bytes, fp32[name].saved_bytes,
        ) and fp32[name].saved_bytes > 0  # fmt: skip
    # fc_b keeps its weight as cast to bf16 for its input's gradient (fc_a's input needs none)
    assert (bf16["fc_b"].cast_bytes, fp32["fc_b"].cast_bytes) == (2 * 32 * 10, 0)
    assert sum(n.forward_ms + n.backward_ms for n in bf16.values()) < sum(
        n.forward_ms + n.backward_ms for n in fp32.values()
    )


@pytest.mark.parametrize("spec", [MLP, "tiny-cnn"])
def test_a_bf16_estimate_has_the_bytes_autocast_gives_on_this_cpu(spec: str) -> None:
    """Outputs, saved activations and weight casts as a measurement under CPU autocast counts them
    (linear layers, convolutions, ReLU and pooling follow the same rules on CUDA and CPU)."""
    measured = profile_model(spec, 4, device="cpu", repeats=1, fixed_cost=False, precision="bf16")
    estimated = profile_model(spec, 4, device_model="h100", precision="bf16")
    assert [(n.id, n.output_bytes, n.saved_bytes, n.cast_bytes) for n in estimated.nodes] == [
        (n.id, n.output_bytes, n.saved_bytes, n.cast_bytes) for n in measured.nodes
    ]


def test_an_estimate_has_the_structure_of_a_measurement() -> None:
    """The same graph, weights, outputs and saved bytes as the profile measured on this CPU."""
    measured = profile_model("tiny-cnn", 2, device="cpu", repeats=1, fixed_cost=False)
    estimated = profile_model("tiny-cnn", 2, device_model="h100")
    assert [(n.id, n.param_bytes, n.output_bytes, n.saved_bytes) for n in estimated.nodes] == [
        (n.id, n.param_bytes, n.output_bytes, n.saved_bytes) for n in measured.nodes
    ]
    assert all(n.forward_ms > 0 for n in estimated.layers)
    launch_ms = PRESETS["h100"].launch_s * 1e3  # fixed time per call: whole kernel launches
    assert all(n.forward_fixed_ms / launch_ms == pytest.approx(round(n.forward_fixed_ms / launch_ms))
               for n in estimated.layers)  # fmt: skip
    assert set(estimated.extra["update_s_per_byte"]) == {"sgd", "momentum", "adam", "adamw"}


def test_a_mixture_of_experts_estimate_says_what_it_assumed() -> None:
    # one trace (a whole profile of the model costs ten seconds more and adds only the three lines
    # that append this assumption to extra.estimate.assumptions)
    from partitioner.models.specs import load_model
    from partitioner.profiler.estimate import LayerEstimator, moe_assumption, on_meta
    from partitioner.profiler.fake import trace_weightless

    bundle = load_model("hf:mixtral", 2, (8,), lazy=True)
    assert "balanced experts" in (moe_assumption(bundle.module) or "")
    assert moe_assumption(load_model("hf:llama", 2, (8,), lazy=True).module) is None
    # the experts' grouped product (which torch's counter does not know) counts: 16 tokens, top 2,
    # each through gate_up (64 -> 2 x 128) and down (128 -> 64), twice that backward
    traced = trace_weightless(bundle, torch.device("cpu"))
    dense = LayerEstimator(on_meta(traced.graph_module), traced.groups, PRESETS["h100"], reuse=False)
    dense.profile(*(t.to("meta") for t in bundle.inputs))
    block = dense.work["model_layers_0_self_attn_q_proj_weight"]
    experts = 16 * 2 * (2 * 64 * 256 + 2 * 128 * 64)
    projections = 16 * 2 * (64 * 64 * 2 + 64 * 32 * 2)  # q, o of 64 x 64; k, v of 64 x 32
    assert block[0].flops >= experts + projections and block[1].flops >= 2 * experts


def test_a_layer_that_fits_no_device_is_named(tmp_path: Path) -> None:
    with pytest.raises(PipeplanError, match=r"layer fc_a has 8\.12 KiB of weights and a test has 3\.91 KiB"):
        profile_model(MLP, 8, device_model=_device(tmp_path, memory_bytes=4000))


def test_the_cpu_model_is_measured_here() -> None:
    model = cpu_model(1, seconds=0.02)
    assert model.name == "cpu" and model.matmul_efficiency == 1.0
    assert model.peak("float32") > 1e8 and model.memory_bandwidth > 1e8 and 0 < model.launch_s < 1e-2
    assert "measured" in model.sources["peak_flops"]
