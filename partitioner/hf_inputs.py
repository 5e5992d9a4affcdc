"""Example inputs and targets for ``hf:`` models, made from the model's config.

Inputs are what a user passes a Hugging Face model by keyword: ``input_ids`` and an all-ones
``attention_mask`` for text, ``decoder_input_ids`` (the labels shifted right, as the model's own
``shift_tokens_right`` makes them) for encoder-decoders, ``pixel_values`` for images. Targets span the
model's whole output range (its vocabulary or ``num_labels``), and pipeplan's default cross-entropy on
the logits then equals the loss the model computes itself when given ``labels``: next tokens for a
causal LM, the labels for masked LM, seq2seq and classification.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from partitioner.errors import ModelSpecError

__all__ = ["hf_bundle_parts", "next_token_targets"]

_SEED = 1234
_DEFAULT_TOKENS = 32

InputMaker = Callable[[int], tuple[Tensor, ...]]
TargetMaker = Callable[[int], Tensor]


def next_token_targets(tokens: Tensor) -> Tensor:
    """Targets of a causal LM: each position predicts the next token; the last one is ignored (-100)."""
    targets = torch.full_like(tokens, -100)
    targets[:, :-1] = tokens[:, 1:]
    return targets


def hf_bundle_parts(
    spec: str, input_shape: tuple[int, ...] | None
) -> tuple[Callable[[], nn.Module], tuple[str, ...], InputMaker, TargetMaker]:
    """(factory, input names, input maker, target maker) for an ``hf:`` spec.

    Raises:
        ModelSpecError: transformers is missing, the spec names nothing loadable, or the shape is wrong.
    """
    try:
        from runtime import hf

        parsed = hf.parse_spec(spec)
        config = hf.load_config(parsed)
    except ImportError as exc:
        raise ModelSpecError(f"{spec} needs transformers: pip install 'pipeplan[hf]' ({exc})") from exc
    except (ValueError, OSError) as exc:
        raise ModelSpecError(f"{exc}; families: {', '.join(hf.FAMILIES)}") from exc
    if parsed.task == "image-cls":
        return (hf.factory(spec), ("pixel_values",), *_image(config, input_shape, spec))
    return (hf.factory(spec), *_text(config, parsed.task, input_shape, spec))


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(_SEED)


def _tokens(config: Any, input_shape: tuple[int, ...] | None, spec: str) -> int:
    if input_shape is not None and len(input_shape) != 1:
        raise ModelSpecError(
            f"{spec} takes token ids: --input-shape is the sequence length, got {input_shape}"
        )
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    tokens = input_shape[0] if input_shape else min(_DEFAULT_TOKENS, limit or _DEFAULT_TOKENS)
    if limit and tokens > limit:
        raise ModelSpecError(f"{spec} has {limit} positions; --input-shape {tokens} is longer")
    return int(tokens)


def _text(
    config: Any, task: str, input_shape: tuple[int, ...] | None, spec: str
) -> tuple[tuple[str, ...], InputMaker, TargetMaker]:
    tokens, vocab = _tokens(config, input_shape, spec), int(config.vocab_size)

    def ids(b: int, offset: int = 0) -> Tensor:
        g = _generator()
        g.manual_seed(_SEED + offset)
        return torch.randint(1, vocab, (b, tokens), generator=g)  # 0 is often the padding token

    def labels(b: int) -> Tensor:
        if task == "seq-cls":
            return torch.randint(0, int(config.num_labels), (b,), generator=_generator())
        if task == "causal-lm":
            return next_token_targets(ids(b))
        return ids(b, offset=1) if task == "seq2seq" else ids(b, offset=2)

    def make_inputs(b: int) -> tuple[Tensor, ...]:
        first = ids(b)
        mask = torch.ones_like(first)
        if task != "seq2seq":
            return (first, mask)
        start = getattr(config, "decoder_start_token_id", None)
        decoder = torch.roll(labels(b), 1, dims=1)
        decoder[:, 0] = int(start if start is not None else 0)
        return (first, mask, decoder)

    names = ("input_ids", "attention_mask") + (("decoder_input_ids",) if task == "seq2seq" else ())
    return names, make_inputs, labels


def _image(config: Any, input_shape: tuple[int, ...] | None, spec: str) -> tuple[InputMaker, TargetMaker]:
    size = int(getattr(config, "image_size", 224))
    shape = tuple(input_shape) if input_shape else (int(getattr(config, "num_channels", 3)), size, size)
    if len(shape) != 3:
        raise ModelSpecError(f"{spec} takes images: --input-shape is C,H,W, got {shape}")

    def make_inputs(b: int) -> tuple[Tensor, ...]:
        return (torch.randn((b, *shape), generator=_generator()),)

    def make_targets(b: int) -> Tensor:
        return torch.randint(0, int(config.num_labels), (b,), generator=_generator())

    return make_inputs, make_targets
