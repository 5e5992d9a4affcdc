"""Stage checkpoints: ``D/step-<N>/stage<K>.pt`` = {"model", "optimizer", "step"}, written atomically
(plus "scheduler", the learning-rate schedule's state, and "optim", the settings: runtime.optim).

``N`` counts completed minibatches. A step folder is complete when every stage's file is there (each
file appears whole or not at all: temp file + rename), so ``--resume`` takes the newest complete one
and a job killed in the middle of writing one simply resumes from the one before.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["latest_complete_step", "load_stage", "save_stage", "stage_path"]

_STEP = re.compile(r"^step-(\d+)$")


def stage_path(root: Path, step: int, stage: int) -> Path:
    return root / f"step-{step}" / f"stage{stage}.pt"


def save_stage(root: Path, step: int, stage: int, state: dict[str, Any]) -> Path:
    """Write one stage's checkpoint through a temporary file and a rename."""
    path = stage_path(root, step, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def latest_complete_step(root: Path, stages: int) -> int | None:
    """The newest step with a checkpoint of every stage, or None."""
    steps = []
    for child in root.iterdir() if root.is_dir() else ():
        match = _STEP.match(child.name)
        if match and all((child / f"stage{k}.pt").is_file() for k in range(stages)):
            steps.append(int(match.group(1)))
    return max(steps, default=None)


def load_stage(root: Path, step: int, stage: int, device: torch.device) -> dict[str, Any]:
    """Read one stage's checkpoint onto ``device``."""
    state: dict[str, Any] = torch.load(stage_path(root, step, stage), map_location=device, weights_only=True)
    return state
