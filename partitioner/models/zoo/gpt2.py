"""A GPT-2 decoder in plain torch (no transformers needed), with the LM head tied to the token embedding.

Sizes and parameter counts follow OpenAI's GPT-2: ``gpt2`` 124,439,808 and ``gpt2-medium`` 354,823,168
parameters (tied weights counted once). Linear layers replace GPT-2's Conv1D (same parameters).
Inputs are integer token ids of shape (batch, sequence).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "byte_gpt", "gpt2", "gpt2_medium", "tiny_gpt"]


@dataclass(frozen=True)
class GPTConfig:
    """Decoder hyper-parameters.

    Attributes:
        vocab_size: number of token ids.
        n_positions: longest sequence the position embedding covers.
        n_embd: width of the residual stream.
        n_layer: number of transformer blocks.
        n_head: attention heads per block.
        dropout: dropout after embeddings, attention and MLP (GPT-2 trains with 0.1).
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention through scaled_dot_product_attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Shapes come from constants, not x.shape: a traced graph then never passes Python ints between
        # layers, so any cut between layers only has tensors to send.
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.unflatten(-1, (self.n_head, -1)).transpose(1, 2)
        k = k.unflatten(-1, (self.n_head, -1)).transpose(1, 2)
        v = v.unflatten(-1, (self.n_head, -1)).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        out: torch.Tensor = self.resid_dropout(self.c_proj(y.transpose(1, 2).flatten(2)))
        return out


class MLP(nn.Module):
    """Position-wise feed-forward, 4x wide, tanh-approximated GELU as GPT-2 uses."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dropout(self.c_proj(self.act(self.c_fc(x))))
        return out


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm, tied LM head -> logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        out: torch.Tensor = self.lm_head(self.ln_f(x))
        return out


def gpt2() -> GPT:
    """GPT-2 small: 12 layers, 768 wide, 12 heads."""
    return GPT(GPTConfig())


def gpt2_medium() -> GPT:
    """GPT-2 medium: 24 layers, 1024 wide, 16 heads."""
    return GPT(GPTConfig(n_embd=1024, n_layer=24, n_head=16))


def tiny_gpt() -> GPT:
    """Two 32-wide blocks over a 97-token vocabulary: fast enough for tests, same structure as GPT-2."""
    return GPT(GPTConfig(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=2))


def byte_gpt() -> GPT:
    """Four 128-wide blocks over bytes (a vocabulary of 256, so ``--data text:FILE`` needs no
    tokenizer), sequences up to 256, no dropout: 0.86M parameters, trained in minutes on a CPU."""
    return GPT(GPTConfig(vocab_size=256, n_positions=256, n_embd=128, n_layer=4, n_head=4, dropout=0.0))
