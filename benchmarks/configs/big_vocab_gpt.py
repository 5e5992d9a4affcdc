"""A 1-block GPT over gpt2's vocabulary (50257), 64 tokens: its logits outweigh every layer's
activations, so its peak memory is the loss's (docs/fidelity.md: the memory of the loss)."""

from __future__ import annotations

import torch
from torch import nn

from partitioner.models.zoo.gpt2 import GPT, GPTConfig

VOCAB, TOKENS = 50257, 64


def model() -> nn.Module:
    return GPT(GPTConfig(vocab_size=VOCAB, n_positions=TOKENS, n_embd=32, n_layer=1, n_head=2, dropout=0.0))


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, TOKENS)),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, TOKENS))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())
