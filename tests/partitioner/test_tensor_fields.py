"""The 3D planner's node fields of estimated decoder layers (docs/layout-3d.md)."""

from __future__ import annotations

import pytest

from partitioner.graph import Node, Profile


def test_estimated_decoder_layers_carry_the_fields() -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    from partitioner.profiler.tensor_fields import with_tensor_fields

    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4,
        num_hidden_layers=1, vocab_size=32,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    names = tuple(n for n, _ in model.named_parameters() if ".layers.0." in n)
    node = Node("l0", "model.layers.0", "call_module", "LlamaDecoderLayer", ("x",), 1.0, 2.0,
                output_bytes=2 * 16 * 64 * 4, param_bytes=10**9, param_names=names)  # fmt: skip
    profile = Profile((Node("x", "x", "input", "input"), node), batch_size=2)
    done = with_tensor_fields(profile, model).nodes[1]
    projections = 64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 96
    assert done.tp_param_bytes == projections * 4
    assert done.tp_max == 4 and done.tp_comm_bytes == 2 * node.output_bytes
