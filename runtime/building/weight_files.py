"""Initial weights by name from a file or folder, reading only the tensors asked for.

A rank starting from pretrained weights needs its own stage's tensors, never the whole checkpoint in
memory. Three layouts are read:

- a ``torch.save(model.state_dict())`` file (``.pt``/``.pth``/``.bin``): memory-mapped, so only the
  tensors taken are read from disk;
- a ``.safetensors`` file;
- a folder holding ``model.safetensors.index.json`` (``save_pretrained``'s sharded layout: a
  ``weight_map`` from tensor name to shard file) or a single ``model.safetensors``: only the shards
  that hold the asked-for tensors are opened, and only those tensors are read from them.

Names are the model's own (``model.layers.0.mlp.up_proj.weight``), as ``state_dict()`` and
``save_pretrained`` write them.

Example:
    >>> found = read_tensors("llama-8b/", ["model.embed_tokens.weight"])  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["INDEX", "SINGLE", "checkpoint_names", "missing", "read_tensors"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _layout(path: str) -> tuple[str, dict[str, str]]:
    """(kind, name -> file) for safetensors layouts; kind ``pt`` has an empty map (names from the file).

    Raises:
        FileNotFoundError: no such path, or a folder without either safetensors layout.
        ValueError: an index that is not a safetensors index.
    """
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                doc = json.load(f)
            weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map; it is not a safetensors index")
            return "safetensors", {str(k): os.path.join(path, str(v)) for k, v in weight_map.items()}
        single = os.path.join(path, SINGLE)
        if os.path.isfile(single):
            return "safetensors", dict.fromkeys(_safetensors_names(single), single)
        raise FileNotFoundError(f"{path} holds neither {INDEX} nor {SINGLE}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no weights file or folder {path}")
    if path.endswith(".safetensors"):
        return "safetensors", dict.fromkeys(_safetensors_names(path), path)
    return "pt", {}


def _safetensors_names(file: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        return list(f.keys())


def _torch_state(path: str) -> Mapping[str, Any]:
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, Mapping):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state_dict")
    return state


def checkpoint_names(path: str) -> set[str]:
    """Every tensor name the weights at ``path`` hold (reads the index or headers, not the tensors)."""
    kind, files = _layout(path)
    return set(files) if kind == "safetensors" else set(_torch_state(path))


def read_tensors(path: str, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors called ``names`` (those present; the caller decides what a missing one means).

    They map the file privately (torch's and safetensors' memory-mapped loading): a page is read
    from disk when first touched and copied when first written, so a tensor costs its own size once,
    and the file is never changed.
    """
    wanted = list(dict.fromkeys(names))
    kind, files = _layout(path)
    if kind == "pt":
        state = _torch_state(path)
        return {n: state[n] for n in wanted if n in state}
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name in wanted:
        if name in files:
            by_file.setdefault(files[name], []).append(name)
    found: dict[str, torch.Tensor] = {}
    for file, inside in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in inside:
                found[name] = f.get_tensor(name)
    return found


def missing(path: str, tensors: Iterable[Iterable[str]]) -> list[str]:
    """The first name of each tensor that the weights at ``path`` hold under none of its names.

    ``tensors`` gives each tensor's names: one, or all the names of a tied weight (a checkpoint keeps a
    tied weight once, under any of them).

    Raises:
        FileNotFoundError, ValueError, OSError, RuntimeError: ``path`` is no readable weights layout.
    """
    held = checkpoint_names(path)
    gaps = []
    for names in tensors:
        names = list(names)
        if names and not held.intersection(names):
            gaps.append(names[0])
    return gaps
