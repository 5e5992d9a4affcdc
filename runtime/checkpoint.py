"""Checkpoints: ``D/step-<N>/`` holds what an exact continuation after ``N`` minibatches needs.

``stage<K>.pt`` = {"model", "optimizer", "scheduler", "optim", "scaler", "precision", "step"} of stage K
(written by its first replica; "scheduler" is the learning-rate schedule's state, "optim" the
settings: runtime.optim; "scaler" fp16's loss scale, runtime.loss_scale, None otherwise),
``rank<R>.pt`` = {"rng", "step"}: the random generator states of rank R (dropout draws differ per
rank), and ``meta.json``, written last by rank 0 once every rank has written its files, names the
package the step belongs to (and the run's seed). Each file appears whole or not at all (temp file +
rename). The data position is the step itself (minibatches are addressed by step) and the schedule
restarts at a step boundary, so these files are the whole state. Asynchronous pipedream drains its
pipeline at every checkpoint: a run with checkpoints every N steps is the run to compare a resumed one
with.

:func:`resume_point` is the launcher's choice of step: the newest complete step whose files all
read back, of this package; it skips torn or truncated steps and removes temp files a kill left.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.errors import RunError

__all__ = [
    "META",
    "ResumePoint",
    "load_rank",
    "load_stage",
    "package_fingerprint",
    "resume_point",
    "rng_state",
    "save_meta",
    "save_rank",
    "save_stage",
    "set_rng_state",
    "stage_path",
    "step_problem",
    "steps_in",
]

META = "meta.json"
_STEP = re.compile(r"^step-(\d+)$")


def stage_path(root: Path, step: int, stage: int) -> Path:
    return root / f"step-{step}" / f"stage{stage}.pt"


def _rank_path(root: Path, step: int, rank: int) -> Path:
    return root / f"step-{step}" / f"rank{rank}.pt"


def _save(path: Path, state: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def _load(path: Path, device: torch.device, mmap: bool = False) -> dict[str, Any]:
    try:
        state: dict[str, Any] = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:  # weights_only's refusal: dozens of lines in torch's words
        raise RunError(
            f"cannot read checkpoint {path}: torch.load(weights_only=True) refused it, as it holds Python "
            f"objects besides tensors ({_refusal(exc)}); pipeplan writes none, so this file was not "
            "written by `pipeplan run` or was altered: give another --checkpoint-dir or --step"
        ) from exc
    except (OSError, RuntimeError, EOFError, zipfile.BadZipFile) as exc:
        raise RunError(f"cannot read checkpoint {path}: {type(exc).__name__}: {_first_line(exc)}") from exc
    return state


def _refusal(exc: BaseException) -> str:
    """What weights_only refused (``Unsupported global: GLOBAL builtins.print``), from torch's text."""
    for line in str(exc).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip().split(" was not an allowed")[0][:150]
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def save_stage(root: Path, step: int, stage: int, state: dict[str, Any]) -> Path:
    """Write one stage's model and optimizer state through a temporary file and a rename."""
    return _save(stage_path(root, step, stage), state)


def load_stage(root: Path, step: int, stage: int, device: torch.device, mmap: bool = False) -> dict[str, Any]:
    """Read one stage's checkpoint onto ``device`` (``mmap``: tensors are read only when touched)."""
    return _load(stage_path(root, step, stage), device, mmap)


def rng_state() -> dict[str, Any]:
    """This process's generator states: CPU, and every CUDA device's where CUDA is up."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_rank(root: Path, step: int, rank: int) -> Path:
    """Write this rank's generator states for ``step``."""
    return _save(_rank_path(root, step, rank), {"rng": rng_state(), "step": step})


def load_rank(root: Path, step: int, rank: int) -> dict[str, Any]:
    return _load(_rank_path(root, step, rank), torch.device("cpu"))


def package_fingerprint(package: Path) -> str:
    """A hash of what decides the checkpoint's layout: mp_conf.json and every stage's code."""
    digest = hashlib.sha256()
    for path in sorted([package / "mp_conf.json", *package.glob("stage*.py")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def save_meta(root: Path, step: int, package: Path, world_size: int, seed: int | None = None) -> Path:
    """Mark ``step`` complete: written by rank 0 after every rank saved its files."""
    doc = {"schema": "pipeplan.checkpoint/1", "step": step, "package": str(package),
           "fingerprint": package_fingerprint(package), "world_size": world_size, "seed": seed}  # fmt: skip
    path = root / f"step-{step}" / META
    tmp = path.with_name(f".{META}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class ResumePoint:
    """Where ``--resume`` continues.

    Attributes:
        step: the step to continue after; None: no usable checkpoint, start from step 0.
        skipped: one line per newer step that could not be used, and why.
        removed: temp files of interrupted writes that were deleted.
    """

    step: int | None
    skipped: tuple[str, ...] = ()
    removed: int = 0


def resume_point(root: Path, package: Path, stages: int, world_size: int) -> ResumePoint:
    """The newest step of ``root`` that is complete, readable and written by this package.

    Raises:
        RunError: the newest complete step belongs to another package (another model, or stages
            swapped): resuming from it would fail deep in load_state_dict, or train the wrong layers.
    """
    removed = 0
    for tmp in root.glob("step-*/.*.tmp") if root.is_dir() else ():
        tmp.unlink(missing_ok=True)
        removed += 1
    skipped: list[str] = []
    mine = package_fingerprint(package)
    for step in steps_in(root):
        problem = step_problem(root, step, stages, world_size)
        if problem:
            skipped.append(f"step-{step}: {problem}")
            continue
        meta = json.loads((root / f"step-{step}" / META).read_text(encoding="utf-8"))
        if meta.get("fingerprint") != mine:
            raise RunError(
                f"{root}/step-{step} was written by the package {meta.get('package')}, not by {package} "
                "(another model, or other stages); use another --checkpoint-dir, or drop --resume"
            )
        return ResumePoint(step, tuple(skipped), removed)
    return ResumePoint(None, tuple(skipped), removed)


def steps_in(root: Path) -> list[int]:
    """The steps that have a ``step-N`` folder under ``root``, newest first (complete or not)."""
    names = [c.name for c in root.iterdir()] if root.is_dir() else []
    return sorted((int(m[1]) for name in names if (m := _STEP.match(name))), reverse=True)


def step_problem(root: Path, step: int, stages: int, world_size: int) -> str | None:
    """Why ``step`` cannot be resumed from or exported (a missing or unreadable file), or None."""
    folder = root / f"step-{step}"
    files = [folder / f"stage{k}.pt" for k in range(stages)] + [
        folder / f"rank{r}.pt" for r in range(world_size)
    ]
    missing = [f.name for f in [folder / META, *files] if not f.is_file()]
    if missing:
        return f"incomplete, no {missing[0]}"
    for path in files:
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (OSError, zipfile.BadZipFile) as exc:
            return f"{path.name} is unreadable ({exc})"
        if bad is not None:
            return f"{path.name} is corrupt (record {bad})"
    return None
