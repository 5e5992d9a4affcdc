"""A layer's backward working bytes: the gradients of its outputs and inputs it holds at once, never
the views of weights or saved tensors a backward takes, measured alike by every profiler."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from partitioner.hardware.devices import DeviceModel, save_device_model
from partitioner.profiler.profile import profile_model
from partitioner.profiler.working import backward_working, split_deferred

torch.set_num_threads(1)

HERE = Path(__file__).parent


def test_a_linear_holds_its_output_and_input_gradients_not_its_weight() -> None:
    """The backward of a 1024 -> 4096 linear takes ``t()`` of its 16 MiB weight: a view, not memory."""
    layer = nn.Linear(1024, 4096)
    x = torch.randn(8, 1024).requires_grad_()
    with torch.enable_grad():
        out = layer(x.clone())
    seed = torch.ones_like(out)
    assert backward_working([out], [x], [seed]) == out.nbytes + x.nbytes
    assert backward_working([out], [], [seed]) == out.nbytes  # the model's first layer: its seed only
    # the graph is kept for the caller's own backward
    torch.autograd.grad([out], [x, layer.weight], [seed])


def test_an_in_place_relu_holds_two_gradients_not_its_saved_output() -> None:
    """ReLU's backward detaches the output it saved (the same storage) and makes one new gradient."""
    x = torch.randn(4, 64, 32, 32).requires_grad_()
    with torch.enable_grad():
        out = torch.relu_(x.clone())
    assert backward_working([out], [x], [torch.ones_like(out)]) == 2 * out.nbytes


def _device(tmp_path: Path) -> str:
    model = DeviceModel(
        "test", "a made-up device", {"float32": 1e12}, 1e30, 2**40, 1.0, 1.0, 0.0, float32_conv="float32"
    )
    return str(save_device_model(replace(model), tmp_path / "device.json"))


def test_measured_and_estimated_profiles_record_each_layers_working_bytes(tmp_path: Path) -> None:
    """tiny-mlp (16 -> 32 -> 32 -> 10, batch 4): fc1's input needs no gradient, so its backward holds
    its seed alone; a ReLU and fc2 hold the gradients of their output and input. The estimate counts
    the same bytes on the meta device."""
    f = 4  # bytes of a float32
    want = {"fc1": 4 * 32 * f, "act1": 2 * 4 * 32 * f, "fc2": 2 * 4 * 32 * f, "fc3": 4 * 10 * f + 4 * 32 * f}
    measured = profile_model("tiny-mlp", batch_size=4, device="cpu", repeats=1)
    estimated = profile_model("tiny-mlp", batch_size=4, device_model=_device(tmp_path))
    for profile in (measured, estimated):
        got = {name: profile.node(name).working_bytes for name in want}
        assert got == want


def test_a_split_backward_keeps_each_linears_output_gradient_for_w() -> None:
    """B records the gradient flowing into each weight's node (a linear's: the gradient of its
    output); W reads it. A layer whose input takes no gradient keeps its seeds (W does it all)."""
    layer = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32))
    x = torch.randn(8, 64).requires_grad_()
    with torch.enable_grad():
        out = layer(x.clone())
    seed, params = torch.ones_like(out), list(layer.parameters())
    assert split_deferred([out], [x], params, [seed]) == 8 * 256 * 4 + 8 * 32 * 4
    assert split_deferred([out], [], params, [seed]) == 8 * 32 * 4
    assert split_deferred([out], [x], [], [seed]) == 0  # no weights: nothing for W


def test_profiles_record_what_a_split_backward_keeps(tmp_path: Path) -> None:
    """tiny-mlp at batch 4: each linear keeps the gradient of its output for W, a ReLU nothing; the
    estimate counts the same on the meta device."""
    f = 4
    want = {"fc1": 4 * 32 * f, "act1": 0, "fc2": 4 * 32 * f, "fc3": 4 * 10 * f}
    measured = profile_model("tiny-mlp", batch_size=4, device="cpu", repeats=1)
    estimated = profile_model("tiny-mlp", batch_size=4, device_model=_device(tmp_path))
    for profile in (measured, estimated):
        assert {name: profile.node(name).deferred_bytes for name in want} == want
