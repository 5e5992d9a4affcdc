"""Example inputs and targets for ``hf:`` models, a task for each head, made from the model's config.

Inputs are what a user passes a Hugging Face model by keyword: ``input_ids`` and an all-ones
``attention_mask`` for text, ``decoder_input_ids`` for encoder-decoders, ``pixel_values`` for images,
``input_features`` (log-mel frames) for speech. They are described as data (:data:`DataSpec`, the
``inputs``/``targets`` of plan.json) and drawn by :func:`runtime.building.stage_init.synthetic_example`, the
function a generated package draws its synthetic minibatches with: the profile measures the inputs a
package trains on. Each head gets a task its model cannot solve by copying an input:

- causal-lm: the next tokens (a causal model does not see them);
- masked-lm: 15% of the tokens hidden behind a mask token and scored against what they hid;
- seq2seq, speech-seq2seq: labels drawn on their own, the decoder reading them shifted right (as the
  model's own ``shift_tokens_right`` makes them);
- seq-cls, image-cls: classes drawn independently of the inputs.

pipeplan's default cross-entropy on the logits then equals the loss the model computes itself when
given ``labels``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from partitioner.errors import ModelSpecError

__all__ = ["DataSpec", "hf_bundle_parts", "next_token_targets"]

_DEFAULT_TOKENS = 32
_DEFAULT_FRAMES = 32

DataSpec = tuple[list[dict[str, Any]], dict[str, Any]]
"""(one spec per input, the target spec): what :func:`runtime.building.stage_init.synthetic_example` reads."""


def next_token_targets(tokens: Tensor) -> Tensor:
    """Targets of a causal LM: each position predicts the next token; the last one is ignored (-100)."""
    targets = torch.full_like(tokens, -100)
    targets[:, :-1] = tokens[:, 1:]
    return targets


def hf_bundle_parts(
    spec: str, input_shape: tuple[int, ...] | None
) -> tuple[Callable[[], nn.Module], tuple[str, ...], DataSpec]:
    """(factory, input names, data spec) for an ``hf:`` spec.

    Raises:
        ModelSpecError: transformers is missing, the spec names nothing loadable, or the shape is wrong.
    """
    try:
        from runtime.building import hugging_face as hf

        parsed = hf.parse_spec(spec)
        config = hf.load_config(parsed)
    except ImportError as exc:
        raise ModelSpecError(f"{spec} needs transformers: pip install 'pipeplan[hf]' ({exc})") from exc
    except (ValueError, OSError) as exc:
        raise ModelSpecError(str(exc)) from exc
    if parsed.task == "image-cls":
        data = _image(config, input_shape, spec)
    elif parsed.task == "speech-seq2seq":
        data = _speech(config, input_shape, spec)
    else:
        data = _text(config, parsed.task, input_shape, spec)
    return hf.factory(spec), tuple(s["name"] for s in data[0]), data


def _positions(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_target_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _tokens(config: Any, input_shape: tuple[int, ...] | None, spec: str) -> int:
    if input_shape is not None and len(input_shape) != 1:
        raise ModelSpecError(
            f"{spec} takes token ids: --input-shape is the sequence length, got {input_shape}"
        )
    limit = _positions(config)
    tokens = input_shape[0] if input_shape else min(_DEFAULT_TOKENS, limit or _DEFAULT_TOKENS)
    if limit and tokens > limit:
        raise ModelSpecError(f"{spec} has {limit} positions; --input-shape {tokens} is longer")
    return int(tokens)


def _ids(name: str, tokens: int, high: int, config: Any = None) -> dict[str, Any]:
    """Token ids in ``[1, high)`` (0 is often the padding token); ``max_length``: the positions the
    model has, which a run's ``--seq-len`` must not exceed."""
    spec: dict[str, Any] = {"name": name, "shape": [1, tokens], "dtype": "int64", "low": 1, "high": high}
    limit = _positions(config) if config is not None else None
    return {**spec, "max_length": limit} if limit else spec


def _classes(config: Any) -> dict[str, Any]:
    return {
        "name": "target",
        "shape": [1],
        "dtype": "int64",
        "kind": "classes",
        "high": int(config.num_labels),
    }


def _text(config: Any, task: str, input_shape: tuple[int, ...] | None, spec: str) -> DataSpec:
    tokens, vocab = _tokens(config, input_shape, spec), int(config.vocab_size)
    mask = {"name": "attention_mask", "shape": [1, tokens], "dtype": "int64", "fill": 1}
    if task == "seq2seq":
        ids = [_ids(name, tokens, vocab, config) for name in ("input_ids", "decoder_input_ids")]
        inputs = [ids[0], mask, ids[1]]
        return inputs, _shifted(config, 2, tokens, vocab)
    if task == "masked-lm":
        mask_token = getattr(config, "mask_token_id", None)
        if not isinstance(mask_token, int) or not 0 <= mask_token < vocab:
            mask_token = vocab - 1  # random weights: any id the inputs never hold is a mask token
        high = vocab - 1 if mask_token == vocab - 1 else vocab
        target = {"name": "target", "shape": [1, tokens], "dtype": "int64", "kind": "masked", "high": vocab,
                  "input": 0, "mask_token": mask_token}  # fmt: skip
        return [_ids("input_ids", tokens, high, config), mask], target
    if task == "seq-cls":
        return [_ids("input_ids", tokens, vocab, config), mask], _classes(config)
    target = {"name": "target", "shape": [1, tokens], "dtype": "int64", "kind": "next_token", "high": vocab}
    return [_ids("input_ids", tokens, vocab, config), mask], target


def _shifted(config: Any, decoder: int, tokens: int, vocab: int) -> dict[str, Any]:
    start = getattr(config, "decoder_start_token_id", None)
    return {"name": "target", "shape": [1, tokens], "dtype": "int64", "kind": "shifted", "low": 1,
            "high": vocab, "decoder": decoder, "start": int(start if start is not None else 0)}  # fmt: skip


def _image(config: Any, input_shape: tuple[int, ...] | None, spec: str) -> DataSpec:
    size = int(getattr(config, "image_size", 224))
    shape = tuple(input_shape) if input_shape else (int(getattr(config, "num_channels", 3)), size, size)
    if len(shape) != 3:
        raise ModelSpecError(f"{spec} takes images: --input-shape is C,H,W, got {shape}")
    return [{"name": "pixel_values", "shape": [1, *shape], "dtype": "float32"}], _classes(config)


def _speech(config: Any, input_shape: tuple[int, ...] | None, spec: str) -> DataSpec:
    """Log-mel frames (``num_mel_bins`` x frames; the encoder's convolutions halve the frames into
    ``max_source_positions``, which a Whisper encoder requires exactly) and decoder token ids."""
    bins, positions = int(config.num_mel_bins), int(getattr(config, "max_source_positions", 0) or 0)
    frames = 2 * positions if positions else _DEFAULT_FRAMES
    if input_shape is not None and len(input_shape) != 1:
        raise ModelSpecError(
            f"{spec} takes audio features and decoder tokens: --input-shape is the decoder's token "
            f"count, got {input_shape} (the encoder reads {bins} mel bins x {frames} frames)"
        )
    tokens, vocab = _tokens(config, input_shape, spec), int(config.vocab_size)
    features = {"name": "input_features", "shape": [1, bins, frames], "dtype": "float32"}
    return [features, _ids("decoder_input_ids", tokens, vocab, config)], _shifted(config, 1, tokens, vocab)
