"""Models whose ``loss_fn(output, target)`` reads the output as the model returns it: a Hugging Face
``ModelOutput`` (``output.logits``), a dict and a tuple, each with a term computed early in the model
(so the last stage must receive it). The loss fails on a bare tensor."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, TOKENS = 50, 8


class _Tokens(nn.Module):
    """Embedding, four residual blocks and a head; ``aux`` is the first block's mean square."""

    def __init__(self, structure: str) -> None:
        super().__init__()
        self.structure = structure
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> Any:
        h = self.embed(tokens)
        aux = torch.zeros(())
        for i, block in enumerate(self.blocks):
            h = h + torch.tanh(block(h))
            if i == 0:
                aux = h.pow(2).mean()
        logits = self.head(h)
        if self.structure == "dict":
            return {"logits": logits, "aux": aux}
        return (logits, aux)


def dict_model() -> nn.Module:
    return _Tokens("dict")


def tuple_model() -> nn.Module:
    return _Tokens("tuple")


def hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(1, VOCAB, (batch_size, TOKENS)),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, TOKENS))


def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the logits plus a small share of ``aux`` where the model returns one."""
    if isinstance(output, tuple):
        logits, aux = output
    elif hasattr(output, "logits"):  # a ModelOutput: reading .logits fails on a bare tensor
        logits, aux = output.logits, torch.zeros((), device=output.logits.device)
    else:
        logits, aux = output["logits"], output["aux"]
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), target.reshape(-1)) + 0.01 * aux
