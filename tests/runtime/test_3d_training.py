"""3D stages (docs/layout-3d.md) train exactly as plain single-process training: an hf:llama-shaped
config (4 layers, hidden 128, 8 heads, 4 KV heads), an hf:qwen2-shaped one and a user's own MLP
file, split over tensor ranks (DTensor weights), sharded over copies (FSDP2) or both, under 1f1b and
zbv: after 4 SGD steps with momentum every weight equals plain training's on the same microbatches
within 1e-5 of its tensor's largest value. A few layouts per model keep this file near two minutes
on two cores; the rest of the matrix was run by hand (benchmarks/results/run3d_matrix.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader

from runtime.checkpoint import step_dir
from runtime.config import load_job
from runtime.errors import RunError
from tests.runtime.helpers import run
from tests.runtime.packages3d import LLAMA, QWEN2, config_file, generate_3d
from tests.runtime.reference3d import assert_trained_as_plain, plain_state

profiler = pytest.importorskip("partitioner.profiler")

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

MLP_FILE = Path(__file__).with_name("mlp3d_model.py")
STEPS, MICRO, BATCH = 4, 4, 8
SGD: dict[str, Any] = {"lr": 0.05, "momentum": 0.9}


def _profile(tmp: Path, which: str) -> Any:
    spec = f"{MLP_FILE}:model" if which == "mlp" else config_file(tmp, {"llama": LLAMA, "qwen2": QWEN2}[which])
    return profiler.profile_model(spec, batch_size=BATCH, repeats=1)


def _trains_as_plain(tmp: Path, profile: Any, name: str, layouts: list[tuple[int, int, str]], schedule: str) -> Path:
    """Generate, run 4 steps, compare with plain training; returns the checkpoint folder."""
    pkg = generate_3d(tmp / name, profile, layouts, schedule, MICRO, BATCH)
    ckpt = tmp / f"{name}-ckpt"
    run(pkg, steps=STEPS, checkpoint_dir=str(ckpt), **SGD)
    want = plain_state(pkg, STEPS, MICRO, BATCH, **SGD)
    assert assert_trained_as_plain(ckpt, STEPS, len(layouts), want) > 10
    return ckpt


def _chunks(ckpt: Path, name: str) -> int:
    """How many pieces the checkpoint holds of tensor ``name`` (one per shard written)."""
    return len(FileSystemReader(str(step_dir(ckpt, STEPS))).read_metadata().state_dict_metadata[f"model.{name}"].chunks)


def test_llama_shaped_3d_layouts(tmp_path: Path) -> None:
    """PP2 x DP2 x TP2 fully sharded (8 ranks), PP2 x DP2 sharding the optimizer (4 ranks), and
    PP2 x TP2 under zbv (4 stages on 2 copies of 2 tensor ranks: the backward split into B and W on
    DTensor weights)."""
    profile = _profile(tmp_path, "llama")
    ckpt = _trains_as_plain(tmp_path, profile, "tp-dp-full", [(2, 2, "full"), (2, 2, "full")], "1f1b")
    assert _chunks(ckpt, "model.layers.3.self_attn.q_proj.weight") == 4  # split 2 ways, sharded 2 ways
    ckpt = _trains_as_plain(tmp_path, profile, "dp-optimizer", [(1, 2, "optimizer"), (1, 2, "optimizer")], "1f1b")
    assert _chunks(ckpt, "model.layers.0.mlp.up_proj.weight") == 2
    ckpt = _trains_as_plain(tmp_path, profile, "tp-zbv", [(2, 1, "none")] * 4, "zbv")
    assert _chunks(ckpt, "model.layers.0.self_attn.o_proj.weight") == 2
    assert _chunks(ckpt, "model.norm.weight") == 1  # replicated inside the tensor group


def test_qwen2_shaped_and_mlp_file(tmp_path: Path) -> None:
    """qwen2 (biased query, key and value projections, split with their biases) as PP2 x DP2 x TP2
    sharding gradients; the user's MLP (a plan found in the traced graph) as PP2 x TP2 under zbv."""
    ckpt = _trains_as_plain(tmp_path, _profile(tmp_path, "qwen2"), "q", [(2, 2, "gradients")] * 2, "1f1b")
    assert _chunks(ckpt, "model.layers.1.self_attn.k_proj.bias") == 4
    ckpt = _trains_as_plain(tmp_path, _profile(tmp_path, "mlp"), "m", [(2, 1, "none")] * 4, "zbv")
    assert _chunks(ckpt, "blocks.0.fc1.weight") == 2 and _chunks(ckpt, "head.weight") == 1


def test_bad_3d_layouts_are_refused_before_any_rank_starts(tmp_path: Path) -> None:
    """A degree the key-value heads do not divide, pipedream with tensor parallelism, a shard level
    under a split backward: one line each, naming what is wrong."""
    profile = _profile(tmp_path, "llama")
    eight = generate_3d(tmp_path / "t8", profile, [(1, 1, "none"), (8, 1, "none")], "1f1b", MICRO, BATCH)
    with pytest.raises(RunError, match=r"stage 1: tensor_parallel 8 does not divide layer model\.layers\.\d\.self_attn .*dividing 4"):
        run(eight, steps=1)
    tp = generate_3d(tmp_path / "tp", profile, [(2, 1, "none"), (2, 1, "none")], "1f1b", MICRO, BATCH)
    with pytest.raises(RunError, match="pipedream keeps weight versions"):
        load_job(tp, schedule="pipedream")
    dp = generate_3d(tmp_path / "dp", profile, [(1, 2, "full"), (1, 2, "full")], "1f1b", MICRO, BATCH)
    with pytest.raises(RunError, match="zb1p splits each backward"):
        load_job(dp, schedule="zb1p")
