"""Hugging Face models from ``hf:`` specs, built with transformers' own config and loader classes.

A spec names where the model comes from and, optionally, the task head:

- ``hf:llama`` (a family name): a small default config of that family, random weights;
- ``hf:path/to/config.json``: that config, random weights;
- ``hf:path/to/folder``: a local checkpoint folder, weights loaded by ``from_pretrained``
  (``local_files_only``: nothing is downloaded);
- ``hf:SOURCE:TASK``: the head, one of :data:`TASKS` (default: the family's usual one).

The profiler, the code generator and every rank of a generated package build the model through
:func:`factory`, so it lives here, beside what a cluster node needs: it imports torch and, lazily,
transformers.

Example:
    >>> model = factory("hf:llama")()  # doctest: +SKIP
    >>> type(model).__name__  # doctest: +SKIP
    'LlamaForCausalLM'
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["FAMILIES", "TASKS", "HfSpec", "absolute_spec", "factory", "load_config", "parse_spec"]

# task -> the transformers Auto class that adds its head
TASKS: dict[str, str] = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq-cls": "AutoModelForSequenceClassification",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "image-cls": "AutoModelForImageClassification",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",
}

_DECODER = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4}
_SMALL = {**_DECODER, "vocab_size": 512, "max_position_embeddings": 128}
_ENC_DEC = {"vocab_size": 512, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
            "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128}  # fmt: skip
# family -> (model_type, default task, config overrides): tiny configs that run in seconds on a CPU
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("llama", "causal-lm", {**_SMALL, "num_key_value_heads": 2}),
    "mistral": ("mistral", "causal-lm", {**_SMALL, "num_key_value_heads": 2, "sliding_window": None}),
    "mixtral": (
        "mixtral",
        "causal-lm",
        {**_SMALL, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen2": ("qwen2", "causal-lm", {**_SMALL, "num_key_value_heads": 2}),
    "gemma": ("gemma", "causal-lm", {**_SMALL, "num_key_value_heads": 2, "head_dim": 16}),
    "phi3": ("phi3", "causal-lm", {**_SMALL, "num_key_value_heads": 2, "pad_token_id": 0}),
    "gpt2": ("gpt2", "causal-lm", {**_SMALL, "bos_token_id": 0, "eos_token_id": 0}),
    "opt": ("opt", "causal-lm", {**_SMALL, "ffn_dim": 128, "word_embed_proj_dim": 64}),
    "gpt_neox": ("gpt_neox", "causal-lm", _SMALL),
    "bert": ("bert", "masked-lm", _SMALL),
    "roberta": ("roberta", "masked-lm", {**_SMALL, "max_position_embeddings": 130, "pad_token_id": 1}),
    "distilbert": ("distilbert", "masked-lm", {**_SMALL, "hidden_dim": 128}),
    "electra": ("electra", "masked-lm", {**_SMALL, "embedding_size": 64}),
    "t5": ("t5", "seq2seq", {"vocab_size": 512, "d_model": 64, "d_ff": 128, "d_kv": 16, "num_heads": 4,
                             "num_layers": 2, "num_decoder_layers": 2, "decoder_start_token_id": 0}),
    "bart": ("bart", "seq2seq", {**_ENC_DEC, "max_position_embeddings": 128}),
    "vit": ("vit", "image-cls", {**_DECODER, "image_size": 32, "patch_size": 8, "num_labels": 10}),
    # beyond the first sixteen: families whose tracing or data needed more than the above
    "falcon": ("falcon", "causal-lm", {**_SMALL, "num_kv_heads": 2}),
    "gemma2": ("gemma2", "causal-lm", {**_SMALL, "num_key_value_heads": 2, "head_dim": 16}),
    "deberta-v2": ("deberta-v2", "masked-lm", _SMALL),
    "whisper": ("whisper", "speech-seq2seq", {**_ENC_DEC, "num_mel_bins": 16, "max_source_positions": 16,
                                              "max_target_positions": 64, "decoder_start_token_id": 1,
                                              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "qwen3": ("qwen3", "causal-lm", {**_SMALL, "num_key_value_heads": 2, "head_dim": 16}),
    "olmo2": ("olmo2", "causal-lm", {**_SMALL, "num_key_value_heads": 2}),
    "phi": ("phi", "causal-lm", _SMALL),
    "bloom": ("bloom", "causal-lm", {"vocab_size": 512, "hidden_size": 64, "n_layer": 4, "n_head": 4}),
    "starcoder2": ("starcoder2", "causal-lm", {**_SMALL, "num_key_value_heads": 2, "sliding_window": None}),
    "albert": ("albert", "masked-lm", {**_SMALL, "embedding_size": 32}),
    "mpnet": ("mpnet", "masked-lm", {**_SMALL, "max_position_embeddings": 130}),
    "mbart": ("mbart", "seq2seq", {**_ENC_DEC, "max_position_embeddings": 128}),
    "pegasus": ("pegasus", "seq2seq", {**_ENC_DEC, "max_position_embeddings": 128}),
    "convnext": ("convnext", "image-cls", {"image_size": 32, "num_channels": 3, "depths": [1, 1, 1, 1],
                                           "hidden_sizes": [16, 32, 48, 64], "num_labels": 10}),
    "swin": ("swin", "image-cls", {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [1, 1],
                                   "num_heads": [2, 4], "window_size": 4, "num_labels": 10}),
    "deit": ("deit", "image-cls", {**_DECODER, "image_size": 32, "patch_size": 8, "num_labels": 10,
                                   "architectures": ["DeiTForImageClassification"]}),  # (two heads)
    # forward passes that branch on tensor values: kept whole where they do (profiler/leaf_calls.py)
    "jetmoe": ("jetmoe", "causal-lm", {**_SMALL, "num_hidden_layers": 2, "num_key_value_heads": 2,
                                       "kv_channels": 16, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "dbrx": ("dbrx", "causal-lm", {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4,
                                   "max_seq_len": 128,
                                   "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                   "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4,
                                                  "moe_top_k": 2}}),
    "led": ("led", "seq2seq", {**_ENC_DEC, "max_encoder_position_embeddings": 128,
                               "max_decoder_position_embeddings": 128, "attention_window": [8, 8]}),
}  # fmt: skip


_DROPOUTS = (
    "hidden_dropout_prob", "attention_probs_dropout_prob", "dropout_rate", "dropout", "attention_dropout",
    "activation_dropout", "classifier_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout",
    "seq_classif_dropout", "qa_dropout",
)  # fmt: skip


@dataclass(frozen=True)
class HfSpec:
    """A parsed ``hf:`` spec.

    Attributes:
        source: a family name, a ``config.json`` path or a checkpoint folder.
        task: one of :data:`TASKS`.
        family: the family name when ``source`` is one, else None.
    """

    source: str
    task: str
    family: str | None


def parse_spec(spec: str) -> HfSpec:
    """Split ``hf:SOURCE[:TASK]``; raises ValueError naming the forms when it is none of them."""
    body = spec.removeprefix("hf:")
    source, sep, task = body.rpartition(":")
    if not sep or task not in TASKS:
        if sep and (source in FAMILIES or os.path.exists(source)) and not os.path.exists(body):
            raise ValueError(f"{spec!r}: no task {task!r}; tasks: {', '.join(TASKS)}")
        source, task = body, ""
    if not source:
        raise ValueError(f"{spec!r}: name a family ({', '.join(FAMILIES)}), a config.json or a folder")
    family = source if source in FAMILIES else None
    if family is None and not os.path.exists(source):
        raise ValueError(
            f"{spec!r}: {source!r} is no family ({', '.join(FAMILIES)}) and no such config.json or folder"
        )
    if not task:
        task = FAMILIES[family][1] if family else _task_of(load_config(HfSpec(source, "", None)))
    return HfSpec(source, task, family)


def absolute_spec(spec: str) -> str:
    """The spec with a path source made absolute, so a package finds it from any working directory."""
    parsed = parse_spec(spec)
    source = parsed.family or os.path.abspath(parsed.source)
    return f"hf:{source}:{parsed.task}"


def load_config(spec: HfSpec) -> Any:
    """The transformers config: a family's small default, a config.json, or a folder's config."""
    import transformers

    if spec.family is not None:
        model_type, _, overrides = FAMILIES[spec.family]
        config = transformers.AutoConfig.for_model(model_type, **overrides)
        for name in _DROPOUTS:  # the small defaults are exact: no random masks to reproduce
            if isinstance(getattr(config, name, None), float):
                setattr(config, name, 0.0)
    else:
        path = spec.source
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    config.use_cache = False
    return config


def factory(spec: str) -> Callable[[], nn.Module]:
    """A zero-argument factory for ``spec``: random weights from a config, or a folder's weights.

    For a folder holding safetensors weights the factory also carries ``pretrained`` (the folder) and
    ``from_config`` (the same model with random weights), so a pipeline stage can be built from the
    config and read only its own tensors from the folder instead of loading the whole model.
    """
    parsed = parse_spec(spec)

    def from_config() -> nn.Module:
        import transformers

        auto = getattr(transformers, TASKS[parsed.task])
        return auto.from_config(load_config(parsed))  # type: ignore[no-any-return]

    def build() -> nn.Module:
        import transformers

        if not (os.path.isdir(parsed.source) and _has_weights(parsed.source)):
            return from_config()
        auto = getattr(transformers, TASKS[parsed.task])
        config = load_config(parsed)
        return auto.from_pretrained(parsed.source, config=config, local_files_only=True)  # type: ignore[no-any-return]

    build.__qualname__ = f"hf_factory[{spec}]"
    if os.path.isdir(parsed.source) and any(n.endswith(".safetensors") for n in os.listdir(parsed.source)):
        build.pretrained = os.path.abspath(parsed.source)  # type: ignore[attr-defined]
        build.from_config = from_config  # type: ignore[attr-defined]
    return build


def _has_weights(folder: str) -> bool:
    return any(name.endswith((".safetensors", ".bin")) for name in os.listdir(folder))


def _task_of(config: Any) -> str:
    """The task a config's ``architectures`` name (``LlamaForCausalLM`` -> causal-lm)."""
    names = " ".join(getattr(config, "architectures", None) or ())
    if getattr(config, "num_mel_bins", None):  # audio features in, text out (whisper, speech_to_text)
        return "speech-seq2seq"
    for suffix, task in (
        ("ForCausalLM", "causal-lm"),
        ("LMHeadModel", "causal-lm"),
        ("ForMaskedLM", "masked-lm"),
        ("ForSequenceClassification", "seq-cls"),
        ("ForConditionalGeneration", "seq2seq"),
        ("ForImageClassification", "image-cls"),
    ):
        if suffix in names:
            return task
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    return "causal-lm"
