"""Hugging Face attention traced as it runs eagerly: no mask tensor where the mask says nothing.

In eager mode, a Hugging Face model given no padding calls ``scaled_dot_product_attention`` with no
mask (``is_causal`` for a decoder, nothing for an encoder), which lets PyTorch pick the flash kernel.
Under torch.export it cannot read the padding mask's values, so it builds the causal mask as a tensor
and passes it: the stage code then runs attention with an explicit boolean mask (no flash kernel) and
sends that mask between stages. Measured on an H100 (benchmarks/gpu_layer_ops.py, one Llama-3-70B
layer, bfloat16, 4096 tokens): 13.5 ms forward and 29.9 ms backward with the mask, 12.0 and 26.8 ms
without; the attention kernels alone 6.9 against 2.1 ms.

pipeplan's inputs for ``hf:`` models never pad (an all-ones ``attention_mask``: hf_inputs.py, and
runtime.datasets.minibatches completes token files with ones), so while such a model is exported, the sdpa
mask function returns no mask exactly where transformers itself would skip it eagerly with no padding: no
sliding window or chunk (``local_size``), no mask that transformers marks as not skippable (packed
sequences, or/and masks, token-type overlays), queries and keys of one length from position 0.
Everything else is built as transformers builds it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["masks_as_eager"]


def _skippable(kwargs: dict[str, Any]) -> bool:
    """What transformers' own eager skip asks, the padding aside (there is none)."""
    if kwargs.get("local_size") is not None:
        return False
    if not (kwargs.get("allow_is_causal_skip") or kwargs.get("allow_is_bidirectional_skip")):
        return False
    offsets = (kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0))
    if not all(isinstance(o, int) and o == 0 for o in offsets):
        return False
    q, kv = kwargs.get("q_length"), kwargs.get("kv_length")
    return q is not None and (q is kv or bool(q == kv))


@contextlib.contextmanager
def masks_as_eager(spec: str) -> Iterator[None]:
    """While a ``hf:`` model is traced, its sdpa masks are skipped where eager mode skips them.

    Other models (a user's file, built-in ones) are traced untouched: their inputs may pad.
    """
    if not spec.startswith("hf:"):
        yield
        return
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as masks
    except ImportError:  # a transformers without mask interfaces builds masks its own way
        yield
        return
    original: Callable[..., Any] = masks["sdpa"]
    had_local = "sdpa" in masks._local_mapping

    def sdpa_mask(*args: Any, **kwargs: Any) -> Any:
        return None if not args and _skippable(kwargs) else original(*args, **kwargs)

    masks["sdpa"] = sdpa_mask
    try:
        yield
    finally:
        if had_local:
            masks["sdpa"] = original
        else:
            del masks["sdpa"]  # type: ignore[no-untyped-call]
