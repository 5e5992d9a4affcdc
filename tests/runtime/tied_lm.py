"""A small language model with what checkpoints and export must map back, as a model file.

A token embedding tied to the LM head (on different stages when cut in the middle), a persistent
buffer, one that state_dict leaves out, and a module the forward never calls (no stage holds it). No
dropout: a pipeline and the unsplit model compare exactly.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SOURCE", "write_model"]

SOURCE = """
import torch
from torch import nn


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("gain", torch.full((16,), 0.5))
        self.register_buffer("scratch", torch.zeros(16), persistent=False)
        self.unused = nn.Linear(2, 2)

    def forward(self, idx):
        return self.head(self.body(self.embed(idx) * self.gain + self.scratch))


def factory():
    return TiedLM()


def example_inputs(batch_size):
    return torch.randint(0, 50, (batch_size, 8))


def example_targets(batch_size):
    return torch.randint(0, 50, (batch_size, 8))
"""


def write_model(folder: Path) -> str:
    """Write the model file into ``folder``; returns its spec for ``pipeplan profile``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tied_lm.py").write_text(SOURCE)
    return f"{folder / 'tied_lm.py'}:factory"
