"""A Mixtral-shaped config (transformers' MixtralConfig: 4 layers, hidden 128, 8 heads, 4 KV heads,
4 experts, 2 a token) as PP2 x TP2 on CPU ranks over gloo: attention split by heads, the experts
replicated inside each tensor group (docs/layout-3d.md), and 4 SGD steps with momentum end with the
weights of plain single-process training on the same microbatches (1e-5 of each tensor's largest)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.runtime.helpers import run
from tests.runtime.packages3d import MIXTRAL, config_file, generate_3d
from tests.runtime.reference3d import assert_trained_as_plain, plain_state

profiler = pytest.importorskip("partitioner.profiler.profile")

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

STEPS, MICRO, BATCH = 4, 4, 8
SGD = {"lr": 0.05, "momentum": 0.9}


def test_mixtral_shaped_pp2_tp2_splits_attention_keeps_experts_whole(tmp_path: Path) -> None:
    profile = profiler.profile_model(config_file(tmp_path, MIXTRAL), batch_size=BATCH, repeats=1)
    pkg = generate_3d(tmp_path / "pkg", profile, [(2, 1, "none")] * 2, "1f1b", MICRO, BATCH)
    layers = json.loads((pkg / "tensor_plan.json").read_text(encoding="utf-8"))["layers"]
    split = {name: how for lay in layers for name, how in lay["params"].items()}
    assert {n.rsplit(".", 2)[-2] for n in split} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert len(split) == 4 * MIXTRAL["num_hidden_layers"]
    assert not any("expert" in n or "gate" in n for n in split)
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=STEPS, checkpoint_dir=str(ckpt), timeout=120, **SGD)
    want = plain_state(pkg, STEPS, MICRO, BATCH, **SGD)
    assert assert_trained_as_plain(ckpt, STEPS, 2, want) > 10
