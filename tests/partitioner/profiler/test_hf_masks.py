"""Hugging Face attention is traced as it runs eagerly on unpadded inputs: no mask tensor."""

from __future__ import annotations

import pytest
import torch

from partitioner.models.specs import load_model
from partitioner.profiler.hf_masks import masks_as_eager
from partitioner.profiler.trace import trace_model

pytest.importorskip("transformers")


def _attention_calls(spec: str, shape: tuple[int, ...]) -> list[torch.fx.Node]:
    traced = trace_model(load_model(spec, 2, shape))
    target = torch.ops.aten.scaled_dot_product_attention.default
    return [n for n in traced.graph_module.graph.nodes if n.target is target]


def test_a_causal_decoder_attends_with_is_causal_and_no_mask() -> None:
    """With a mask tensor PyTorch cannot run the flash kernel (1.13x a 70B layer's time on an H100)."""
    calls = _attention_calls("hf:llama", (16,))
    assert calls
    for node in calls:
        mask, _, causal = [*node.args, None, 0.0, False][3:6]
        assert mask is None and causal is True, node.format_node()


def test_the_traced_model_computes_what_the_eager_one_does() -> None:
    bundle = load_model("hf:llama", 2, (16,))
    traced = trace_model(bundle)
    torch.manual_seed(0)
    inputs = bundle.make_inputs(2)
    named = dict(zip(bundle.input_names, inputs, strict=True))
    eager = bundle.module(**named)
    logits = eager.logits if hasattr(eager, "logits") else eager
    got = traced.graph_module(**named)
    got = got.logits if hasattr(got, "logits") else got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-5)


def test_a_sliding_window_keeps_its_mask() -> None:
    """A window shorter than the sequence is a mask that is_causal cannot say."""
    from transformers import MistralConfig, MistralForCausalLM
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=64, sliding_window=4,
                           use_cache=False)  # fmt: skip
    config._attn_implementation = "sdpa"
    model = MistralForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 12))
    with masks_as_eager("hf:mistral"):
        program = torch.export.export(model, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    target = torch.ops.aten.scaled_dot_product_attention.default
    calls = [n for n in program.graph.nodes if n.target is target]
    assert calls and all(isinstance(n.args[3], torch.fx.Node) for n in calls)
    assert "sdpa" not in ALL_MASK_ATTENTION_FUNCTIONS._local_mapping


def test_other_models_and_the_mapping_are_left_alone() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    before = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    with masks_as_eager("my_model.py:make"):
        assert ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is before
    with masks_as_eager("hf:llama"):
        assert ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is not before
    assert ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is before
