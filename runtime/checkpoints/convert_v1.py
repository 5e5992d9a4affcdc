"""Checkpoints of pipeplan before DCP (``pipeplan.checkpoint/1``), converted to today's.

Such a ``step-N/`` holds ``stage<K>.pt`` per stage (``model``: the stage's state_dict; ``optimizer``:
torch's optimizer state_dict, parameters numbered in the stage's order; ``scheduler``, ``scaler``,
``optim``: the settings; ``step``), ``rank<R>.pt`` per rank (``rng``) and ``meta.json``. It loads only
on the package that wrote it. :func:`convert` rewrites it as one DCP checkpoint with the entries of
:mod:`runtime.checkpoints.train_state` (parameters by name), so it resumes on any plan of the model and
exports like any other; the old files move to ``step-N.v1/``. The stage files are memory-mapped: tensors are
read as DCP writes them.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from runtime.checkpoints import safe_read
from runtime.checkpoints import step_folders as checkpoint
from runtime.checkpoints.read_tensors import load_v1_stage
from runtime.errors import RunError
from runtime.packages.job_config import JobConfig, load_job
from runtime.packages.load import import_package, read_wiring
from runtime.packages.tensor_names import ModelNames, model_names, stage_modules

__all__ = ["convert", "v1_steps"]


def v1_steps(root: Path) -> list[int]:
    """The steps of ``root`` in the format before DCP, newest first."""
    return [s for s in checkpoint.steps_in(root) if checkpoint.is_v1(root, s)]


def _trained_names(package: Any, job: JobConfig) -> list[list[str]]:
    """Per stage, its trained parameters in the order its optimizer numbered them."""
    modules = stage_modules(package, read_wiring(package, job.stages, job.module_stages), job.module_stages)
    return [[n for n, p in m.named_parameters() if p.requires_grad] for m in modules]


def _stage_entries(names: ModelNames, k: int, state: dict[str, Any], trained: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {f"model.{names.key(k, n)}": t for n, t in state["model"].items()}
    optimizer = state.get("optimizer") or {}
    for i, values in (optimizer.get("state") or {}).items():
        for key, v in values.items():
            out[f"optimizer.state.{names.key(k, trained[int(i)])}.{key}"] = v
    for group in optimizer.get("param_groups") or ():
        for i in group["params"]:
            for key, v in group.items():
                if key != "params":
                    out[f"optimizer.param_groups.{names.key(k, trained[int(i)])}.{key}"] = v
    return out


def _entries(
    folder: Path, names: ModelNames, trained: list[list[str]], world_size: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every entry of the DCP checkpoint, and stage 0's file (settings, schedule, step)."""
    out: dict[str, Any] = {}
    first: dict[str, Any] = {}
    for k in range(len(names.prefixes)):
        state = load_v1_stage(folder, k)
        first = first or state
        out.update(_stage_entries(names, k, state, trained[k]))
    for rank in range(world_size):
        path = folder / f"rank{rank}.pt"
        try:
            rng = safe_read.load_weights_only(path, path, "the rank's state")["rng"]
        except (OSError, RuntimeError, EOFError, KeyError, TypeError) as exc:
            raise RunError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from exc
        states = {"cpu": rng["cpu"], **{f"cuda{i}": s for i, s in enumerate(rng.get("cuda") or ())}}
        out[f"rng.rank{rank}"] = states
    out["train_state"] = {"step": int(first["step"])}
    if first.get("scheduler") is not None:
        out["lr_scheduler"] = {k: v for k, v in first["scheduler"].items() if k != "lr_lambdas"}
    if first.get("scaler") is not None:
        out["loss_scale"] = first["scaler"]
    return out, first


def _record(old: dict[str, Any], first: dict[str, Any], job: JobConfig, names: ModelNames) -> dict[str, Any]:
    """meta.json of the converted step: what the old one and stage 0's file knew (the run's step
    range and data are unknown, so a resume does not compare them)."""
    return {
        "model": job.model,
        "package": str(old.get("package") or job.package),
        "fingerprint": old.get("fingerprint"),
        "stage_ranks": [list(r) for r in job.stage_ranks],
        "keys": "original" if names.original else "per-stage",
        "seed": old.get("seed"),
        "precision": first.get("precision"),
        "optim": first.get("optim"),
        "converted_from": "pipeplan.checkpoint/1",
    }


def convert(root: Path, package: Path, step: int | None = None) -> list[int]:
    """Rewrite ``step`` (default: every old-format step) of ``root`` as DCP; returns the steps converted.

    Raises:
        RunError: no such step, a step of another format, or files that do not read.
    """
    job = load_job(package)
    pkg = import_package(job.package)
    names, trained = model_names(pkg, job), _trained_names(pkg, job)
    steps = v1_steps(root) if step is None else [step]
    if not steps:
        raise RunError(f"{root} has no per-stage (pipeplan.checkpoint/1) steps to convert")
    for s in steps:
        folder = checkpoint.step_dir(root, s)
        if not checkpoint.is_v1(root, s):
            raise RunError(f"{folder} is not a per-stage checkpoint (no stage0.pt)")
        try:
            old = json.loads((folder / checkpoint.META).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise RunError(f"cannot read {folder / checkpoint.META}: {exc}") from exc
        entries, first = _entries(folder, names, trained, int(old.get("world_size") or job.world_size))
        partial = root / f"step-{s}.partial"
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp_save(entries, checkpoint_id=str(partial), no_dist=True)
        os.replace(folder, root / f"step-{s}.v1")
        checkpoint.publish(root, s, _record(old, first, job, names))
    return steps
