"""Measurement: every built-in model profiles; bytes, ties and times are what autograd really does."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner.graph import Profile
from partitioner.models.specs import load_model
from partitioner.models.zoo import ZOO
from partitioner.profiler.measure import LayerProfiler, Stopwatch, measure_step
from partitioner.profiler.profile import profile_model
from partitioner.profiler.trace import trace_model

torch.set_num_threads(1)

HERE = Path(__file__).parent


def small_shape(name: str) -> tuple[int, ...]:
    entry = ZOO[name]
    if entry.tokens:
        return (4,) if name == "gpt2-medium" else (8,)
    if len(entry.input_shape) == 3:
        return (3, 64, 64) if name == "alexnet" else (3, 32, 32)
    return entry.input_shape


def check_profile(profile: Profile) -> None:
    position = {n.id: i for i, n in enumerate(profile.nodes)}
    assert len(position) == len(profile.nodes), "node ids are unique"
    assert all(position[src] < position[n.id] for n in profile.nodes for src in n.inputs)
    assert all(n.forward_ms >= 0 and n.backward_ms >= 0 for n in profile.nodes)
    assert profile.step_ms and profile.step_ms > 0 and profile.fidelity is not None
    assert profile.nodes[0].op == "input" and profile.nodes[-1].op == "output"


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_builtin_profiles(name: str) -> None:
    profile = profile_model(name, batch_size=2, input_shape=small_shape(name), device="cpu", repeats=1)
    check_profile(profile)
    with torch.device("meta"):
        params = sum(p.numel() for p in ZOO[name].factory().parameters())
    assert profile.total_param_bytes == 4 * params  # tied weights counted once
    assert sum(n.saved_bytes for n in profile.nodes) > 0
    assert profile.tracer == "fx" and profile.tracer_options["spec"] == name
    assert profile.extra["non_tensor_edges"] == []  # only tensors cross between layers


def test_non_tensor_edges_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "shaped.py"
    path.write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a = torch.nn.Linear(4, 4)\n"
        "        self.b = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        n = x.shape[0]\n"
        "        h = self.a(x)\n"
        "        return self.b(h).reshape(n, -1) + h.new_zeros(n, 4)\n"
        "def make():\n"
        "    return Net(), torch.randn(2, 4)\n"
    )
    profile = profile_model(f"{path}:make", batch_size=2, device="cpu", repeats=1)
    assert profile.tracer == "fx"
    assert profile.extra["non_tensor_edges"], "x.shape[0] is read by two layers"


def test_tied_weights_are_counted_once_and_recorded() -> None:
    profile = profile_model("tiny-gpt", batch_size=2, device="cpu", repeats=1)
    assert profile.tied == (("wte.weight", "lm_head.weight"),)
    wte, head = profile.node("wte"), profile.node("lm_head")
    assert wte.param_bytes == 97 * 32 * 4 and head.param_bytes == 0
    assert head.param_names == ("lm_head.weight",)


def test_a_layers_largest_weight_is_recorded() -> None:
    """The most gradient a layer's backward makes at once (``Node.largest_tensor_bytes``): a
    linear's weight, not its weight and bias together (``param_bytes``)."""
    fc2 = profile_model("tiny-mlp", batch_size=4, device="cpu", repeats=1).node("fc2")
    assert fc2.param_bytes == (32 * 32 + 32) * 4 and fc2.largest_tensor_bytes == 32 * 32 * 4


def test_saved_bytes_follow_autograd() -> None:
    profile = profile_model("tiny-mlp", batch_size=4, device="cpu", repeats=1)
    x_bytes = 4 * 16 * 4
    # fc1 saves its input x; each ReLU saves its output; fc2/fc3 save the ReLU outputs already counted
    assert profile.node("fc1").saved_bytes == x_bytes
    assert profile.node("act1").saved_bytes == 4 * 32 * 4
    assert profile.node("fc2").saved_bytes == 0
    assert profile.node("fc1").output_bytes == 4 * 32 * 4
    assert profile.node("x").output_bytes == x_bytes
    assert profile.node("fc1").param_names == ("fc1.weight", "fc1.bias")


def test_skip_tensor_crosses_layers() -> None:
    profile = profile_model("tiny-skip", batch_size=2, device="cpu", repeats=1)
    add = next(n for n in profile.nodes if n.target == "add")
    assert "act" in add.inputs and "l4" in add.inputs


def test_inplace_layers_leave_the_captured_values_alone() -> None:
    bundle = load_model("tiny-cnn", batch_size=2)
    traced = trace_model(bundle)
    with torch.no_grad():
        expected = traced.graph_module(*bundle.inputs)
    profiler = LayerProfiler(traced.graph_module, traced.groups, repeats=2)
    costs = profiler.profile(*bundle.inputs)
    assert set(costs) == {g.id for g in traced.groups}
    torch.testing.assert_close(profiler.result, expected)


def test_layer_times_add_up_to_the_step() -> None:
    """Fidelity on a model big enough that timer overhead is noise (loose bounds: shared CI machines)."""
    profile = profile_model("resnet18", batch_size=4, input_shape=(3, 64, 64), device="cpu", repeats=3)
    assert profile.fidelity is not None and 0.5 < profile.fidelity < 2.0


def test_measure_step_and_stopwatch() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    step = measure_step(
        model, (torch.randn(4, 8),), torch.zeros(4, dtype=torch.long), nn.functional.cross_entropy
    )
    assert step.step_ms > 0 and len(step.samples_ms) >= 1 and all(p.grad is None for p in model.parameters())
    times: list[float] = []
    with Stopwatch(torch.device("cpu")).time(times):
        sum(range(1000))
    assert len(times) == 1 and times[0] > 0


def test_progress_callback_counts_every_layer() -> None:
    seen: list[tuple[int, int, str]] = []
    profile = profile_model(
        "tiny-cnn", batch_size=2, device="cpu", repeats=1, progress=lambda *a: seen.append(a)
    )
    assert len(seen) == len(profile.nodes) and seen[-1][0] == seen[-1][1] == len(profile.nodes)


def test_hf_gpt2_profiles_via_export() -> None:
    pytest.importorskip("transformers")
    profile = profile_model(f"{HERE / 'hf_gpt2_model.py'}:make", batch_size=2, device="cpu", repeats=1)
    check_profile(profile)
    assert profile.tracer == "export"
    assert [n.name for n in profile.nodes if n.target == "GPT2Block"] == [
        f"transformer.h.{i}" for i in range(4)
    ]
    assert profile.tied == (("transformer.wte.weight", "lm_head.weight"),)
    bundle = load_model(f"{HERE / 'hf_gpt2_model.py'}:make", 2)
    params = sum(p.numel() for p in bundle.module.parameters())
    assert profile.total_param_bytes == 4 * params
    assert all(n.saved_bytes > 0 for n in profile.nodes if n.target == "GPT2Block")
    assert math.isfinite(profile.total_compute_ms)


def test_cpu_clock() -> None:
    profile = profile_model("tiny-mlp", batch_size=2, device="cpu", repeats=1, clock="cpu")
    assert profile.extra["clock"] == "cpu" and profile.step_ms is not None and profile.step_ms >= 0


def test_bad_repeats_and_device() -> None:
    from partitioner.errors import PipeplanError

    with pytest.raises(PipeplanError, match="--repeats"):
        profile_model("tiny-mlp", repeats=0)
    with pytest.raises(PipeplanError, match="unknown clock"):
        profile_model("tiny-mlp", clock="sundial")
    if not torch.cuda.is_available():
        with pytest.raises(PipeplanError, match="no usable GPU"):
            profile_model("tiny-mlp", device="cuda")


def test_microbatch_size_measures_small_and_scales_up() -> None:
    profile = profile_model("tiny-cnn", batch_size=8, device="cpu", repeats=1, microbatch_size=2)
    assert profile.batch_size == 8 and profile.extra["measured_batch_size"] == 2
    assert profile.inputs[0].shape[0] == 8
    single = profile_model("tiny-cnn", batch_size=2, device="cpu", repeats=1)
    assert [n.output_bytes for n in profile.nodes] == [4 * n.output_bytes for n in single.nodes]
    assert [n.param_bytes for n in profile.nodes] == [n.param_bytes for n in single.nodes]
    from partitioner.errors import PipeplanError

    with pytest.raises(PipeplanError, match="--microbatch-size"):
        profile_model("tiny-mlp", batch_size=2, microbatch_size=3)


def test_bf16_profile_measures_low_precision_outputs_and_weight_copies() -> None:
    fp32 = {n.id: n for n in profile_model("tiny-mlp", batch_size=8, repeats=1).nodes}
    bf16 = {n.id: n for n in profile_model("tiny-mlp", batch_size=8, repeats=1, precision="bf16").nodes}
    assert bf16["fc1"].output_bytes * 2 == fp32["fc1"].output_bytes  # bf16 activations cross a cut
    assert bf16["fc2"].param_bytes == fp32["fc2"].param_bytes == (32 * 32 + 32) * 4  # float32 weights
    assert bf16["fc2"].cast_bytes == 32 * 32 * 2 and fp32["fc2"].cast_bytes == 0  # the bf16 copy kept
    assert bf16["fc1"].cast_bytes == 0  # its input needs no gradient: the copy is not kept


def test_the_loss_records_its_saved_log_softmax_and_its_backward_working_bytes() -> None:
    """A cross-entropy keeps its log-softmax (as large as the logits) for the backward, which then
    holds logits-sized gradients beside it: the bytes a large vocabulary's last stage peaks with."""
    from partitioner.profiler.measure import measure_loss_memory

    logits = torch.randn(4, 16, 5000)
    targets = torch.randint(0, 5000, (4, 16))

    def loss_fn(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())

    saved, working = measure_loss_memory(logits, targets, loss_fn)
    assert saved >= logits.nbytes  # the log-softmax
    assert working >= logits.nbytes  # at least the gradient of the logits it passes on
    assert measure_loss_memory(logits.long(), targets, lambda o, t: o.sum().float()) == (0, 0)


def test_back_to_back_calls_are_timed_together_and_reported_per_call() -> None:
    """The stopwatch's batched form (what a CUDA layer is timed with: several calls between two
    events, no synchronisation between them) gives the time of one call."""
    import time as clock

    times: list[float] = []
    with Stopwatch(torch.device("cpu")).time(times, calls=3):
        for _ in range(3):
            clock.sleep(0.02)
    assert len(times) == 1 and 19.0 <= times[0] < 60.0  # 20 ms each; a sleep is never shorter
    assert Stopwatch(torch.device("cpu")).calls == 1  # a CPU runs each call synchronously


def test_a_layer_timed_back_to_back_runs_each_call_once_and_keeps_its_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Timing ``calls`` back-to-back calls runs the layer that many times per timed repeat (one
    warm-up alone) and records the same output and saved bytes as one call at a time. (A warm-up
    over ``BACK_TO_BACK_BELOW_MS`` times one call instead: lifted here, so a loaded machine does not
    decide the count; it failed once in CI with a 5 ms warm-up of this tiny layer.)"""
    monkeypatch.setattr("partitioner.profiler.measure.BACK_TO_BACK_BELOW_MS", float("inf"))
    bundle = load_model("tiny-mlp", batch_size=4)
    traced = trace_model(bundle)
    seen = [0]
    fc1 = traced.graph_module.get_submodule("fc1")
    fc1.register_forward_hook(lambda *_: seen.__setitem__(0, seen[0] + 1))
    costs = {}
    for calls in (1, 3):
        seen[0] = 0
        profiler = LayerProfiler(traced.graph_module, traced.groups, repeats=2, calls=calls, budget_ms=1e9)
        costs[calls] = profiler.profile(*bundle.inputs)["fc1"]
        assert seen[0] == 1 + 1 + 2 * calls  # the capture run, one warm-up, then calls per repeat
    assert costs[1].output_bytes == costs[3].output_bytes == 4 * 32 * 4
    assert costs[1].saved_bytes == costs[3].saved_bytes == 4 * 16 * 4
