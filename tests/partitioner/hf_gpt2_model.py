"""A 4-layer Hugging Face GPT-2 built from a config (nothing downloaded); torch.fx cannot trace it."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def gpt2_4layer() -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=101, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, 101, (batch_size, 12), generator=torch.Generator().manual_seed(0)),)
