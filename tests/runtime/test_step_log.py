"""Metrics where people look: a JSON line per step per rank as each step ends, TensorBoard event
files that TensorBoard's own reader loads, MFU where FLOPs and a peak are known."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.observing.flops import minibatch_flops, token_count
from runtime.packages.load import import_package, read_wiring
from tests.runtime.generated import generate
from tests.runtime.helpers import run

torch.set_num_threads(1)


def test_flops_of_a_linear_chain_are_the_matmuls_forward_and_backward(tmp_path: Path) -> None:
    """tiny-mlp on the meta device: 2 x in x out per sample and layer forward, twice that backward
    (the first layer's input needs no gradient: one matmul less)."""
    pkg_dir = generate(tmp_path / "pkg", "tiny-mlp", (1, 1), batch_size=4)
    pkg = import_package(pkg_dir)
    wiring = read_wiring(pkg, 2)
    model = pkg.full_model(0)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = tuple(pkg.example_inputs(4).values())
    forward = sum(2 * 4 * m.in_features * m.out_features for m in linears)
    first = 2 * 4 * linears[0].in_features * linears[0].out_features
    want = forward + 2 * forward - first
    assert minibatch_flops(pkg, wiring, (), inputs, pkg.example_targets(4)) == want
    assert token_count(inputs) is None and token_count((torch.zeros(4, 16, dtype=torch.long),)) == 64


@pytest.mark.slow
def test_every_rank_logs_each_step_as_it_ends_and_tensorboard_reads_the_events(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    pkg = generate(
        tmp_path / "gpt", "tiny-gpt", (1, 1), "1f1b", microbatches=2, batch_size=4, input_shape=(8,)
    )
    boards = tmp_path / "tb"
    metrics = run(
        pkg, steps=3, tensorboard=str(boards), peak_tflops=1.0, optimizer="adamw", lr_schedule="cosine"
    )
    for rank in (0, 1):
        lines = [
            json.loads(line)
            for line in (pkg / "run" / "steps" / f"rank{rank}.jsonl").read_text().splitlines()
        ]
        assert [line["step"] for line in lines] == [1, 2, 3] and all(line["rank"] == rank for line in lines)
        for line in lines:
            assert line["step_s"] > 0 and line["samples_per_s"] == pytest.approx(4 / line["step_s"])
            assert line["tokens_per_s"] == pytest.approx(
                4 * 8 / line["step_s"]
            )  # token ids: batch x positions
            assert line["compute_s"] > 0 and line["idle_s"] >= 0 and line["memory_bytes"] > 0
            assert 0 < line["mfu"] < 1
        assert [line["lr"] for line in lines] == pytest.approx([0.01, 0.01 * 0.75, 0.01 * 0.25])
        assert ("loss" in lines[0]) == (rank == 1)
    assert [
        json.loads(x)["loss"] for x in (pkg / "run" / "steps" / "rank1.jsonl").read_text().splitlines()
    ] == metrics["losses"]
    assert metrics["model_flops_per_minibatch"] > 0 and 0 < metrics["mfu"] < 1
    for rank in (0, 1):
        events = event_accumulator.EventAccumulator(str(boards / f"rank{rank}"))
        events.Reload()
        tags = events.Tags()["scalars"]
        assert {"step_s", "samples_per_s", "tokens_per_s", "lr", "compute_s", "mfu"} <= set(tags)
        assert [e.step for e in events.Scalars("step_s")] == [1, 2, 3]
    loss = event_accumulator.EventAccumulator(str(boards / "rank1"))
    loss.Reload()
    assert [e.value for e in loss.Scalars("loss")] == pytest.approx(metrics["losses"])
