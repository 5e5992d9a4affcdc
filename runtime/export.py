"""Merge a run's stage checkpoints into one state_dict of the original, unsplit model.

A generated stage holds the original model's submodules and tensors under their original paths
(``partitioner.stagekit.populate``: ``features.3.weight``, ``transformer.h.0.attn.c_attn.weight``), so
the names in ``step-N/stage<K>.pt`` already are the original model's; merging checks each against the
model, and completes what no stage file names on its own:

- a tied weight (one tensor under several names: GPT-2's token embedding and LM head) gets the value
  of its first name that a stage holds under every one of its names;
- a buffer the original keeps out of its state_dict (``persistent=False``) but a stage read directly
  (and so holds as a plain buffer) is left out;
- a parameter or buffer that no stage holds (a module the forward never calls) keeps the value
  ``full_model(seed)`` gives it: it was never trained, and the run built it from the same seed.

The merged tensors are loaded into the package's ``full_model(seed)`` and its ``state_dict()`` is saved,
so the file holds exactly the original model's names (tied ones under each name, sharing storage) and
``model.load_state_dict(torch.load(path), strict=True)`` loads it. An ``hf:`` model is also written
with ``save_pretrained``. Only torch (and, for ``hf:``, transformers) is needed.

Example:
    >>> done = export_checkpoint("models/vgg16/gpus=2", "model.pt")  # doctest: +SKIP
    >>> model.load_state_dict(torch.load("model.pt"), strict=True)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from runtime import checkpoint
from runtime.config import load_job
from runtime.errors import RunError
from runtime.package import import_package
from runtime.preflight import check_writable, disk_full

__all__ = ["Exported", "Merged", "choose_step", "export_checkpoint", "merge_into"]


@dataclass(frozen=True)
class Merged:
    """What :func:`merge_into` loaded.

    Attributes:
        loaded: original names whose values came from a stage checkpoint.
        tied: original names that took the value of another name of the same tensor.
        untrained: original names no stage holds, left at the model's own (initial) values.
        dropped: stage names left out: buffers the original does not save (``persistent=False``).
        tie_max_diff: the largest difference between two stages' copies of one tied tensor (0.0: equal).
    """

    loaded: tuple[str, ...]
    tied: tuple[str, ...]
    untrained: tuple[str, ...]
    dropped: tuple[str, ...]
    tie_max_diff: float = 0.0


@dataclass(frozen=True)
class Exported:
    """One export.

    Attributes:
        step: the checkpoint step exported.
        path: the state_dict file written.
        hf_dir: the ``save_pretrained`` folder written (``hf:`` models), else None.
        merged: how the stages' tensors mapped onto the model.
        skipped: one line per newer step that could not be used, and why.
        seed: the seed the untrained tensors were built with.
    """

    step: int
    path: Path
    hf_dir: Path | None
    merged: Merged
    skipped: tuple[str, ...] = ()
    seed: int = 0


def _alias_groups(model: nn.Module) -> list[list[str]]:
    """The state_dict names of every tensor, in state_dict order, one group per tensor."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def merge_into(model: nn.Module, stages: Sequence[Mapping[str, torch.Tensor]]) -> Merged:
    """Load every stage's tensors into ``model`` (the original model) under their original names.

    Raises:
        RunError: a stage holds a tensor the model does not have, or one of another shape.
    """
    known = model.state_dict(keep_vars=True)
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    held: dict[str, list[torch.Tensor]] = {}
    dropped: list[str] = []
    for k, state in enumerate(stages):
        for name, tensor in state.items():
            if name in known:
                held.setdefault(name, []).append(tensor)
            elif name in buffers:
                dropped.append(name)
            else:
                raise RunError(
                    f"stage {k} holds {name!r}, which the package's full_model() does not have; export "
                    "merges packages written by `pipeplan partition`, whose stages keep the original names"
                )
    found: dict[str, torch.Tensor] = {}
    tied: list[str] = []
    diff = 0.0
    for group in _alias_groups(model):
        copies = [t for name in group for t in held.get(name, ())]  # one tensor, as each stage holds it
        if not copies:
            continue
        first = copies[0]
        for other in copies[1:]:
            if first.numel() and other.shape == first.shape:
                diff = max(diff, float((other.double() - first.double()).abs().max()))
        tied += [name for name in group if name not in held]
        found.update(dict.fromkeys(group, first))
    untrained = tuple(n for n in known if n not in found)
    try:
        model.load_state_dict(found, strict=False)
    except RuntimeError as exc:
        raise RunError(f"the stage checkpoints do not fit the package's model: {exc}") from exc
    loaded = tuple(n for n in known if n in found and n not in tied)
    return Merged(loaded, tuple(tied), untrained, tuple(dict.fromkeys(dropped)), diff)


def choose_step(
    root: Path, package: Path, stages: int, world_size: int, step: int | None = None
) -> tuple[int, tuple[str, ...]]:
    """``step`` when it is complete, else the newest complete step; with the newer steps skipped.

    Raises:
        RunError: no checkpoints, no such step, an incomplete step, or steps of another package.
    """
    steps = checkpoint.steps_in(root)
    if not steps:
        raise RunError(
            f"no checkpoints in {root}: train with `pipeplan run {package} --checkpoint-every N` (or "
            "--checkpoint-dir DIR), or give --checkpoint-dir"
        )
    if step is not None and step not in steps:
        raise RunError(f"{root} has no step-{step}; it has {', '.join(f'step-{s}' for s in steps)}")
    skipped: list[str] = []
    for candidate in steps if step is None else [step]:
        problem = checkpoint.step_problem(root, candidate, stages, world_size)
        if problem is not None and step is not None:
            raise RunError(f"{root}/step-{step} cannot be exported: {problem} (its run stopped writing it)")
        if problem is not None:
            skipped.append(f"step-{candidate}: {problem}")
            continue
        meta = json.loads((root / f"step-{candidate}" / checkpoint.META).read_text(encoding="utf-8"))
        if meta.get("fingerprint") != checkpoint.package_fingerprint(package):
            raise RunError(
                f"{root}/step-{candidate} was written by the package {meta.get('package')}, not by "
                f"{package}; give that package, or the --checkpoint-dir of a run of this one"
            )
        return candidate, tuple(skipped)
    raise RunError(f"no complete step in {root}: {'; '.join(skipped)}")


def _save_atomic(state: Mapping[str, torch.Tensor], path: Path) -> None:
    """``torch.save`` through a temporary file and a rename (the state_dict as is: its ``_metadata``
    carries the module versions ``load_state_dict`` reads); on failure nothing is left behind and
    the error says why (a full disk reads ``unexpected pos`` in torch's own words).

    Raises:
        RunError: the file cannot be written.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        tmp.unlink(missing_ok=True)
        reason = disk_full(path.parent) or (exc.strerror if isinstance(exc, OSError) else None)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RunError(f"cannot write {path}: {reason or first}; choose another -o") from exc


def check_output(path: Path) -> None:
    """Fail before any checkpoint is read when ``path`` cannot be written (a read-only or full disk).

    Raises:
        RunError: naming the file and why.
    """
    if path.is_dir():
        raise RunError(f"-o {path} is a folder; give a file name such as {path / 'model.pt'}")
    check_writable(path.parent, f"-o {path}")


def export_checkpoint(
    package: str | Path,
    output: str | Path,
    step: int | None = None,
    checkpoint_dir: str | Path | None = None,
    hf_dir: str | Path | None = None,
    seed: int | None = None,
) -> Exported:
    """Merge ``step`` (default: the newest complete one) of a run of ``package`` into ``output``.

    Args:
        package: the package folder the run trained.
        output: the state_dict file to write (``torch.save`` of the original model's ``state_dict()``).
        step: the checkpoint step; None: the newest complete one.
        checkpoint_dir: where the run wrote ``step-N/``; None: ``PACKAGE/run/checkpoints``.
        hf_dir: for an ``hf:`` model, the ``save_pretrained`` folder; None: beside ``output``,
            named after it (``model.pt`` -> ``model-hf/``).
        seed: the seed of tensors no stage holds; None: the run's (recorded in meta.json), else 0.

    Raises:
        RunError: no usable checkpoint, a step that is missing or incomplete, or stages that do not
            fit the package's model.
    """
    job = load_job(package)
    check_output(Path(output))
    root = Path(checkpoint_dir) if checkpoint_dir is not None else job.package / "run" / "checkpoints"
    chosen, skipped = choose_step(root, job.package, job.stages, job.world_size, step)
    meta = json.loads((root / f"step-{chosen}" / checkpoint.META).read_text(encoding="utf-8"))
    seed = seed if seed is not None else int(meta.get("seed") or 0)
    pkg = import_package(job.package)
    if not callable(getattr(pkg, "full_model", None)):
        raise RunError(f"{job.package} has no full_model(); export needs a package of `pipeplan partition`")
    cpu = torch.device("cpu")
    stages = [checkpoint.load_stage(root, chosen, k, cpu, mmap=True)["model"] for k in range(job.stages)]
    model = pkg.full_model(seed)
    merged = merge_into(model, stages)
    out = Path(output)
    _save_atomic(model.state_dict(), out)
    written_hf = None
    if job.model.startswith("hf:"):
        written_hf = Path(hf_dir) if hf_dir is not None else out.with_name(f"{out.stem}-hf")
        if not callable(getattr(model, "save_pretrained", None)):
            raise RunError(f"{job.model} built a {type(model).__name__}, which has no save_pretrained()")
        try:
            model.save_pretrained(written_hf)
        except (OSError, RuntimeError) as exc:
            reason = disk_full(written_hf.parent) or str(exc).strip().splitlines()[0]
            raise RunError(f"wrote {out}, but not {written_hf}: {reason}; give --hf-dir elsewhere") from exc
    return Exported(chosen, out, written_hf, merged, skipped, seed)
