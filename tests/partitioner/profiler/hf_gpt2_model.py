"""A 4-layer Hugging Face GPT-2 built from a config (no weights), for the torch.export fallback tests."""

from __future__ import annotations

import torch
from torch import nn


def make() -> tuple[nn.Module, torch.Tensor]:
    """GPT2LMHeadModel with tied embeddings; token ids of shape (2, 16)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config), torch.randint(0, 64, (2, 16))
