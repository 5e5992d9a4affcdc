"""Reading a checkpoint's tensors in one process, a few at a time: for export, conversion and tests.

:class:`Tensors` reads the weights of a DCP checkpoint (``model.<fqn>`` entries) or of a checkpoint
of pipeplan before DCP (``stage<K>.pt`` files, whose names a package's
:class:`runtime.packages.tensor_names.ModelNames` turns into checkpoint names), by name, so a caller holds
only what it asked for.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime.checkpoints import safe_read
from runtime.checkpoints import step_folders as checkpoint
from runtime.errors import RunError
from runtime.packages.job_config import load_job
from runtime.packages.load import import_package
from runtime.packages.tensor_names import ModelNames, TensorSpec, model_names

__all__ = ["Tensors", "load_v1_stage", "read_stage", "read_values"]


def load_v1_stage(folder: Path, stage: int, mmap: bool = True) -> dict[str, Any]:
    """``stage<K>.pt`` of a checkpoint of pipeplan before DCP (tensors read when touched)."""
    path = folder / f"stage{stage}.pt"
    try:
        state: dict[str, Any] = safe_read.load_weights_only(path, path, "the stage's state", mmap=mmap)
    except (OSError, RuntimeError, EOFError, zipfile.BadZipFile) as exc:
        raise RunError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from exc
    return state


@dataclass
class Tensors:
    """The weights and buffers of one checkpoint step, by checkpoint name.

    Attributes:
        folder: the ``step-N`` folder.
        specs: every name the step holds, with shape and dtype.
        v1: per stage, its ``stage<K>.pt`` model state (checkpoints before DCP), else empty.
        v1_keys: checkpoint name -> (stage, name in its file), for ``v1``.
    """

    folder: Path
    specs: dict[str, TensorSpec]
    v1: list[dict[str, torch.Tensor]] = field(default_factory=list)
    v1_keys: dict[str, tuple[int, str]] = field(default_factory=dict)

    @classmethod
    def open(cls, folder: Path, names: ModelNames | None = None) -> Tensors:
        """A DCP step; or, with the package's ``names``, a step of pipeplan before DCP."""
        if (folder / "stage0.pt").is_file():
            if names is None:
                raise RunError(f"{folder} is a per-stage checkpoint; reading it needs its package")
            states = [load_v1_stage(folder, k)["model"] for k in range(len(names.prefixes))]
            keys = {names.key(k, n): (k, n) for k, state in enumerate(states) for n in state}
            specs = {
                key: (tuple(states[k][n].shape), str(states[k][n].dtype).removeprefix("torch."))
                for key, (k, n) in keys.items()
            }
            return cls(folder, specs, states, keys)
        root, step = folder.parent, int(folder.name.removeprefix("step-"))
        return cls(folder, checkpoint.saved_tensors(root, step))

    def read(self, keys: Iterable[str], prefix: str = "model.") -> dict[str, torch.Tensor]:
        """The tensors of ``keys`` (CPU; DCP reads only these), named without ``prefix``."""
        keys = list(keys)
        if self.v1:
            return {key: self.v1[self.v1_keys[key][0]][self.v1_keys[key][1]] for key in keys}
        out = {
            f"{prefix}{key}": torch.empty(self.specs[key][0], dtype=getattr(torch, self.specs[key][1]))
            for key in keys
        }
        if out:
            safe_read.load(out, self.folder, no_dist=True)
        return {key.removeprefix(prefix): t for key, t in out.items()}


def read_values(folder: Path, keys: Iterable[str]) -> dict[str, Any]:
    """Entries of a DCP step that are not tensors (``lr_scheduler.last_epoch``, ``loss_scale.scale``,
    ``optimizer.param_groups.<fqn>.lr``), by their checkpoint names."""
    out: dict[str, Any] = dict.fromkeys(keys)
    safe_read.load(out, folder, no_dist=True)
    return out


def read_stage(root: Path, step: int, stage: int, package: Path | None = None) -> dict[str, torch.Tensor]:
    """Stage ``stage``'s weights and buffers at ``step``, under the stage's own names (the package
    defaults to the one ``meta.json`` names)."""
    doc = json.loads((checkpoint.step_dir(root, step) / checkpoint.META).read_text(encoding="utf-8"))
    job = load_job(package or Path(doc["package"]), schedule=doc.get("schedule"))
    names = model_names(import_package(job.package), job)
    tensors = Tensors.open(checkpoint.step_dir(root, step), names)
    found = {
        n: next((c for c in names.candidates(names.key(stage, n)) if c in tensors.specs), None)
        for n in names.tensors[stage]
    }
    got = tensors.read({k for k in found.values() if k is not None})
    return {n: got[k] for n, k in found.items() if k is not None}
