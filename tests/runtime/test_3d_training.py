"""3D stages (docs/layout-3d.md) train exactly as plain single-process training: an hf:llama-shaped
config (4 layers, hidden 128, 8 heads, 4 KV heads), an hf:qwen2-shaped one, a user's own MLP file,
hf:gemma2 (attention kept whole) and hf:phi3 (fused projections gathered and sliced), split over
tensor ranks (DTensor weights), sharded over copies (FSDP2) or both, under 1f1b and zbv (with
copies and shard levels too): after 4 SGD steps with momentum every weight equals plain training's
on the same microbatches within 1e-5 of its tensor's largest value. A few layouts per model keep
this file near three minutes on two cores, with the gemma2 (64 s) and phi3 (94 s) tests beside;
the rest of the matrix was run by hand
(benchmarks/bench_3d.py, benchmarks/results/bench_3d.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader

from runtime.checkpoints.step_folders import step_dir
from runtime.errors import RunError
from runtime.packages.job_config import load_job
from tests.runtime.helpers import run
from tests.runtime.packages3d import LLAMA, QWEN2, config_file, generate_3d
from tests.runtime.reference3d import assert_trained_as_plain, plain_state

profiler = pytest.importorskip("partitioner.profiler.profile")

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

MLP_FILE = Path(__file__).with_name("mlp3d_model.py")
STEPS, MICRO, BATCH = 4, 4, 8
SGD: dict[str, Any] = {"lr": 0.05, "momentum": 0.9}


def _profile(tmp: Path, which: str) -> Any:
    spec = (
        f"{MLP_FILE}:model" if which == "mlp" else config_file(tmp, {"llama": LLAMA, "qwen2": QWEN2}[which])
    )
    return profiler.profile_model(spec, batch_size=BATCH, repeats=1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The hf:llama-shaped config's profile, shared by the tests that plan it."""
    return _profile(tmp_path_factory.mktemp("llama"), "llama")


def _trains_as_plain(
    tmp: Path,
    profile: Any,
    name: str,
    layouts: list[tuple[int, int, str]],
    schedule: str,
    recompute: bool = False,
) -> Path:
    """Generate, run 4 steps, compare with plain training; returns the checkpoint folder."""
    pkg = generate_3d(tmp / name, profile, layouts, schedule, MICRO, BATCH, recompute=recompute)
    assert load_job(pkg).recompute == (recompute,) * len(layouts)
    ckpt = tmp / f"{name}-ckpt"
    run(pkg, steps=STEPS, checkpoint_dir=str(ckpt), **SGD)
    want = plain_state(pkg, STEPS, MICRO, BATCH, **SGD)
    assert assert_trained_as_plain(ckpt, STEPS, len(layouts), want) > 10
    return ckpt


def _chunks(ckpt: Path, name: str, step: int = STEPS) -> int:
    """How many pieces the checkpoint holds of tensor ``name`` (one per shard written)."""
    metadata = FileSystemReader(str(step_dir(ckpt, step))).read_metadata()
    return len(metadata.state_dict_metadata[f"model.{name}"].chunks)


def test_llama_shaped_3d_resumes_on_2d_and_3d_and_exports(tmp_path: Path, llama: Any) -> None:
    """PP2 x DP2 x TP2 fully sharded (8 ranks) for 2 steps, resumed on a 2D plan of 3 stages for a
    third, then as PP2 x TP2 under zbv (4 stages on 2 copies of 2 tensor ranks: the backward split
    into B and W on DTensor weights) for a fourth: the weights of 4 steps of plain training; the
    export loads with from_pretrained and gives plain training's logits."""
    import transformers

    from runtime.exporting.model_weights import export_checkpoint
    from runtime.packages.load import import_package

    profile = llama
    full = generate_3d(tmp_path / "a", profile, [(2, 2, "full")] * 2, "1f1b", MICRO, BATCH)
    plain = generate_3d(tmp_path / "b", profile, [(1, 1, "none")] * 3, "1f1b", MICRO, BATCH)
    zbv = generate_3d(tmp_path / "c", profile, [(2, 1, "none")] * 4, "zbv", MICRO, BATCH)
    ckpt = tmp_path / "ckpt"
    run(full, steps=2, checkpoint_dir=str(ckpt), **SGD)
    assert _chunks(ckpt, "model.layers.3.self_attn.q_proj.weight", 2) == 4  # split 2 ways, sharded 2 ways
    run(plain, steps=3, checkpoint_dir=str(ckpt), resume=True, **SGD)
    run(zbv, steps=4, checkpoint_dir=str(ckpt), resume=True, accept_changes=True, **SGD)
    assert _chunks(ckpt, "model.layers.0.self_attn.o_proj.weight") == 2
    assert _chunks(ckpt, "model.norm.weight") == 1  # replicated inside the tensor group
    want = plain_state(full, STEPS, MICRO, BATCH, **SGD)
    assert assert_trained_as_plain(ckpt, STEPS, 4, want) > 10
    done = export_checkpoint(zbv, tmp_path / "out" / "model.safetensors", checkpoint_dir=ckpt)
    assert done.hf_dir is not None
    loaded = transformers.AutoModelForCausalLM.from_pretrained(done.hf_dir).eval()
    ref = import_package(full).full_model(0).eval()
    ref.load_state_dict({k: v for k, v in want.items() if k in ref.state_dict()})
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_llama_shaped_sharded_optimizer(tmp_path: Path, llama: Any) -> None:
    """PP2 x DP2 sharding the optimizer state (ZeRO-1: one reduce-scatter, in each copy's last backward)."""
    ckpt = _trains_as_plain(tmp_path, llama, "opt", [(1, 2, "optimizer")] * 2, "1f1b")
    assert _chunks(ckpt, "model.layers.0.mlp.up_proj.weight") == 2


def test_qwen2_shaped_and_mlp_file(tmp_path: Path) -> None:
    """qwen2 (biased query, key and value projections, split with their biases) as PP2 x DP2 x TP2
    sharding gradients; the user's MLP (a plan found in the traced graph) as PP2 x TP2 under zbv."""
    ckpt = _trains_as_plain(tmp_path, _profile(tmp_path, "qwen2"), "q", [(2, 2, "gradients")] * 2, "1f1b")
    assert _chunks(ckpt, "model.layers.1.self_attn.k_proj.bias") == 4
    ckpt = _trains_as_plain(tmp_path, _profile(tmp_path, "mlp"), "m", [(2, 1, "none")] * 4, "zbv")
    assert _chunks(ckpt, "blocks.0.fc1.weight") == 2 and _chunks(ckpt, "head.weight") == 1


def test_zbv_with_shards_and_with_copies(tmp_path: Path, llama: Any) -> None:
    """zbv (every backward split into B and W; 4 stages as a V on each copy's ranks) with copies:
    llama-shaped PP2 x DP2 fully sharded (FSDP2's sync held through every B and W, one
    reduce-scatter after the copy's last W), and the user's MLP as PP2 x DP2 x TP2 replicated (8
    ranks: each copy a V of its own, each of a rank's two stages all-reducing its shards over its
    own data group), every stage recomputing its forward (the plan's recompute flag on split
    stages, B and W each running the recomputed graph)."""
    ckpt = _trains_as_plain(tmp_path, llama, "zfull", [(1, 2, "full")] * 4, "zbv")
    assert _chunks(ckpt, "model.layers.0.mlp.up_proj.weight") == 2
    mlp = _profile(tmp_path, "mlp")
    _trains_as_plain(tmp_path, mlp, "zcopies", [(2, 2, "none")] * 4, "zbv", recompute=True)


def test_bad_3d_layouts_are_refused_before_any_rank_starts(tmp_path: Path, llama: Any) -> None:
    """A degree the key-value heads do not divide, pipedream with tensor parallelism or a shard
    level, zbv on copies that are not V pipelines of their own: one line each, naming what is wrong."""
    profile = llama
    eight = generate_3d(tmp_path / "t8", profile, [(1, 1, "none"), (8, 1, "none")], "1f1b", MICRO, BATCH)
    with pytest.raises(
        RunError,
        match=r"stage 1: tensor_parallel 8 does not divide layer model\.layers\.\d\.self_attn .*dividing 4",
    ):
        run(eight, steps=1)
    tp = generate_3d(tmp_path / "tp", profile, [(2, 1, "none"), (2, 1, "none")], "1f1b", MICRO, BATCH)
    with pytest.raises(RunError, match="pipedream keeps weight versions"):
        load_job(tp, schedule="pipedream")
    dp = generate_3d(tmp_path / "dp", profile, [(1, 2, "full"), (1, 2, "full")], "1f1b", MICRO, BATCH)
    with pytest.raises(RunError, match="pipedream keeps weight versions"):
        load_job(dp, schedule="pipedream")
    copies = [(1, 2, "full"), (1, 1, "none"), (1, 1, "none"), (1, 2, "full")]  # (stages 1, 2: 1 copy)
    uneven = generate_3d(tmp_path / "v", profile, copies, "zbv", MICRO, BATCH)
    with pytest.raises(RunError, match="only as whole copies of the pipeline"):
        load_job(uneven)


def test_gemma2_attention_kept_whole_trains_as_plain(tmp_path: Path) -> None:
    """hf:gemma2 (eager attention whose traced code reshapes to the whole model's heads) as TP2 x
    DP2 (one stage: its tied embeddings keep 3D layouts to one stage): its attention stays whole in
    each tensor group (partitioner.profiler.tensor_check), its MLPs are split, and the weights end
    as plain training's."""
    profile = profiler.profile_model("hf:gemma2", batch_size=BATCH, repeats=1)
    assert sorted(profile.extra["tensor_parallel_whole"]) == [f"model.layers.{i}.self_attn" for i in range(4)]
    ckpt = _trains_as_plain(tmp_path, profile, "g", [(2, 2, "none")], "1f1b")
    assert _chunks(ckpt, "model.layers.3.mlp.down_proj.weight") == 2
    assert _chunks(ckpt, "model.layers.3.self_attn.q_proj.weight") == 1


def test_phi3_fused_projections_split_gathered_train_as_plain(tmp_path: Path) -> None:
    """hf:phi3 (fused qkv_proj and gate_up_proj, planned colwise_gather_output and
    rowwise_split_input) as PP2 x TP2, and as one stage of TP2 x DP2 fully sharded (FSDP2's
    unsharded parameters found by name): the weights end as plain training's."""
    profile = profiler.profile_model("hf:phi3", batch_size=BATCH, repeats=1)
    assert not profile.extra.get("tensor_parallel_unknown_styles")
    ckpt = _trains_as_plain(tmp_path, profile, "p", [(2, 1, "none")] * 2, "1f1b")
    assert _chunks(ckpt, "model.layers.3.self_attn.qkv_proj.weight") == 2
    assert _chunks(ckpt, "model.layers.3.mlp.down_proj.weight") == 2
    _trains_as_plain(tmp_path, profile, "pf", [(2, 2, "full")], "1f1b")
