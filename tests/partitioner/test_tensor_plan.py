"""The tensor plan: Hugging Face's own base_model_tp_plan where a config ships one, Megatron's pattern
found in the traced graph otherwise, and the profile fields the planner reads from it."""

from __future__ import annotations

from pathlib import Path

import torch

from partitioner.profiler import tensor_plan
from tests.runtime.packages3d import LLAMA, MIXTRAL

MLP = Path(__file__).parents[1] / "runtime" / "mlp3d_model.py"


def _hf(config: dict[str, object]) -> torch.nn.Module:
    import transformers

    fields = {k: v for k, v in config.items() if k != "model_type"}
    cfg = transformers.AutoConfig.for_model(str(config["model_type"]), **fields)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def test_hf_plan_splits_attention_by_heads_and_the_mlp() -> None:
    layers = {lay.name: lay for lay in tensor_plan.derive(None, _hf(LLAMA))}
    attn, mlp = layers["model.layers.0.self_attn"], layers["model.layers.0.mlp"]
    assert attn.tp_max == 4  # gcd of 8 query heads, 4 key-value heads and the features
    assert attn.params["model.layers.0.self_attn.o_proj.weight"] == "rowwise"
    assert (
        mlp.params["model.layers.0.mlp.gate_proj.weight"] == "colwise" and mlp.tp_max == 256
    )  # intermediate size
    assert len(layers) == 8 and not any("embed" in n or "lm_head" in n for n in layers)


def test_mixtral_experts_stay_whole() -> None:
    names = [lay.name for lay in tensor_plan.derive(None, _hf(MIXTRAL))]
    assert names == [f"model.layers.{i}.self_attn" for i in range(4)]


def test_graph_plan_of_a_users_mlp_and_its_profile_fields() -> None:
    from partitioner.profiler import profile

    profile = profile.profile_model(f"{MLP}:model", batch_size=8, repeats=1)
    nodes = {n.name: n for n in profile.nodes}
    fc1, fc2, head = nodes["blocks.0.fc1"], nodes["blocks.0.fc2"], nodes["head"]
    assert (fc1.tp_param_bytes, fc1.tp_comm_bytes, fc1.tp_max) == (64 * 32 * 4 + 64 * 4, 0, 64)
    assert (fc2.tp_param_bytes, fc2.tp_comm_bytes) == (32 * 64 * 4, 8 * 32 * 4)  # its bias stays whole
    assert head.tp_max == 0 and head.tp_param_bytes == 0  # a classifier fed by no linear: whole


def test_phi3s_fused_projections_are_gathered_and_sliced() -> None:
    """Phi-3's plan splits its fused qkv_proj and gate_up_proj column-wise with the output gathered
    and o_proj, down_proj row-wise on a sliced input: the heads are not split, so the degree divides
    the features only; the gathered outputs count half in the forward's communication."""
    model = _hf({**LLAMA, "model_type": "phi3", "pad_token_id": 0})
    layers = {lay.name: lay for lay in tensor_plan.derive(None, model)}
    attn, mlp = layers["model.layers.0.self_attn"], layers["model.layers.0.mlp"]
    assert attn.params == {
        "model.layers.0.self_attn.qkv_proj.weight": "colwise_gather",
        "model.layers.0.self_attn.o_proj.weight": "rowwise_split",
    }
    assert attn.tp_max == 128 and mlp.tp_max == 256  # (qkv 256 features, o 128; not the 4 kv heads)
    assert attn.rowwise_out == (128, 128)  # (half of qkv's 256 gathered, o_proj's 128 all-reduced)
    assert tensor_plan.unknown_styles(model) == {}


def test_unknown_styles_are_named() -> None:
    unknown = tensor_plan.unknown_styles(_hf(MIXTRAL))
    assert unknown and "colwise" not in unknown.values() and "rowwise" not in unknown.values()
    assert tensor_plan.unknown_styles(_hf(LLAMA)) == {}
