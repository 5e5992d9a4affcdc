"""A run's checkpoint as the original, unsplit model's weights: safetensors, a state_dict, or a Hugging
Face folder.

A checkpoint holds the model's tensors under their original names (:mod:`runtime.packages.tensor_names`),
whatever plan wrote it, so export needs the package only for the model's structure, built on the meta device:
its state_dict names, which of them are one tied tensor, which buffers it leaves out. Each name takes:

- the checkpoint's tensor of that name;
- for a tied tensor (GPT-2's token embedding and LM head) that the checkpoint holds under another of
  its names, that one (the copies of a tie split over stages are equal; the largest difference is
  reported);
- for a tensor no stage holds (a module the forward never calls: never trained), nothing in
  safetensors and Hugging Face folders (``from_pretrained`` initialises it, and says so), and in a
  state_dict file the value ``full_model(seed)`` gives it.

Buffers the model keeps out of its state_dict (``persistent=False``) but a stage held are left out.

Formats, by the output's suffix: ``.safetensors`` writes safetensors, one file up to
``max_shard_bytes``, above that ``NAME-0000i-of-0000N.safetensors`` plus ``NAME.safetensors.index.json``
(Hugging Face's layout), a tied tensor once, under its first name. Any other suffix writes
``torch.save`` of the model's ``state_dict()`` (every name, tied ones sharing storage), which
``model.load_state_dict(torch.load(path), strict=True)`` loads. An ``hf:`` model also gets a folder that
``from_pretrained`` reads: its config and the same safetensors shards. Safetensors are written one shard
at a time, reading from the checkpoint only that shard's tensors, so memory is bounded by a shard,
never the model; the state_dict file is the whole model in one process, as its format is.

Example:
    >>> done = export_checkpoint("models/vgg16/gpus=2", "vgg16.safetensors")  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from runtime.checkpoints import step_folders as checkpoint
from runtime.checkpoints.read_tensors import Tensors
from runtime.errors import RunError
from runtime.files.atomic import WriteError, write_atomic
from runtime.job.preflight import check_writable, disk_full
from runtime.job.run_folders import run_folder
from runtime.packages.job_config import load_job
from runtime.packages.load import import_package
from runtime.packages.tensor_names import TensorSpec, model_names

__all__ = ["MAX_SHARD_BYTES", "Exported", "Merged", "choose_step", "export_checkpoint", "match_names"]

MAX_SHARD_BYTES = 5 * 10**9
"""The largest safetensors file before sharding (the Hugging Face Hub's recommended 5 GB)."""


@dataclass(frozen=True)
class Merged:
    """How the checkpoint's tensors map onto the model.

    Attributes:
        loaded: model names whose values the checkpoint holds under that name.
        tied: model names that take the value of another name of the same tensor.
        untrained: model names no stage holds.
        dropped: checkpoint names left out: buffers the model does not save (``persistent=False``).
        tie_max_diff: the largest difference between two held copies of one tied tensor (0.0: equal).
        sources: per model name that has a value, the checkpoint name it comes from.
    """

    loaded: tuple[str, ...]
    tied: tuple[str, ...]
    untrained: tuple[str, ...]
    dropped: tuple[str, ...]
    tie_max_diff: float = 0.0
    sources: Mapping[str, str] | None = None


@dataclass(frozen=True)
class Exported:
    """One export.

    Attributes:
        step: the checkpoint step exported.
        path: the file written (the index, for sharded safetensors).
        files: every weight file written (shards, and the Hugging Face folder's).
        hf_dir: the Hugging Face folder written (``hf:`` models), else None.
        merged: how the checkpoint's tensors mapped onto the model.
        skipped: one line per newer step that could not be used, and why.
        seed: the seed of the untrained tensors (state_dict files).
    """

    step: int
    path: Path
    files: tuple[Path, ...]
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


def match_names(model: nn.Module, held: Mapping[str, TensorSpec]) -> Merged:
    """Map the checkpoint's ``held`` names (with shapes) onto ``model``'s state_dict (built on meta).

    Raises:
        RunError: the checkpoint holds a tensor the model does not have, or one of another shape.
    """
    known = model.state_dict(keep_vars=True)
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    for name, (shape, _) in held.items():
        if name in known and tuple(known[name].shape) != tuple(shape):
            raise RunError(
                f"the checkpoint holds {name!r} of shape {tuple(shape)}, the package's model "
                f"{tuple(known[name].shape)}: it was written for another model"
            )
        if name not in known and name not in buffers:
            raise RunError(
                f"the checkpoint holds {name!r}, which the package's full_model() does not have; export "
                "needs a package of this model written by `pipeplan partition` (whose stages keep the "
                "original names)"
            )
    sources: dict[str, str] = {}
    tied: list[str] = []
    for group in _alias_groups(model):
        present = [n for n in group if n in held]
        if present:
            sources.update({n: (n if n in held else present[0]) for n in group})
            tied += [n for n in group if n not in held]
    dropped = tuple(n for n in held if n not in known)
    loaded = tuple(n for n in known if n in sources and n not in tied)
    return Merged(loaded, tuple(tied), tuple(n for n in known if n not in sources), dropped, 0.0, sources)


def _tie_difference(tensors: Tensors, model: nn.Module) -> float:
    """The largest difference between two held copies of one tied tensor (read a group at a time)."""
    diff = 0.0
    for group in _alias_groups(model):
        held = [n for n in group if n in tensors.specs]
        if len(held) > 1:
            copies = list(tensors.read(held).values())
            diff = max([diff, *(float((c.double() - copies[0].double()).abs().max()) for c in copies[1:])])
    return diff


def choose_step(root: Path, step: int | None = None) -> tuple[int, tuple[str, ...]]:
    """``step`` when it is complete, else the newest complete step; with the newer steps skipped.
    Checkpoints of pipeplan before DCP (``stage<K>.pt``) are read too.

    Raises:
        RunError: no checkpoints, no such step, or an incomplete step.
    """
    steps = checkpoint.steps_in(root)
    if not steps:
        raise RunError(
            f"no checkpoints in {root}: train with `pipeplan run PACKAGE --checkpoint-every N` (or "
            "--checkpoint-dir DIR), or give --checkpoint-dir"
        )
    if step is not None and step not in steps:
        raise RunError(f"{root} has no step-{step}; it has {', '.join(f'step-{s}' for s in steps)}")
    skipped: list[str] = []
    for candidate in steps if step is None else [step]:
        problem = None if checkpoint.is_v1(root, candidate) else checkpoint.step_problem(root, candidate)
        if problem is not None and step is not None:
            raise RunError(f"{root}/step-{step} cannot be exported: {problem} (its run stopped writing it)")
        if problem is None:
            return candidate, tuple(skipped)
        skipped.append(f"step-{candidate}: {problem}")
    raise RunError(f"no complete step in {root}: {'; '.join(skipped)}")


def check_output(path: Path) -> None:
    """Fail before any checkpoint is read when ``path`` cannot be written (a read-only or full disk).

    Raises:
        RunError: naming the file and why.
    """
    if path.is_dir():
        raise RunError(f"-o {path} is a folder; give a file name such as {path / 'model.pt'}")
    check_writable(path.parent, f"-o {path}")


def _meta_model(pkg: ModuleType, seed: int) -> nn.Module:
    """The package's full model with every tensor on the meta device (no memory)."""
    with torch.device("meta"):
        if "device" in inspect.signature(pkg.full_model).parameters:
            return pkg.full_model(seed, device="meta")  # type: ignore[no-any-return]
        return pkg.full_model(seed)  # type: ignore[no-any-return]


def _first_names(model: nn.Module, merged: Merged) -> list[str]:
    """The names safetensors holds: each tensor once (the first of its names), with a value."""
    return [g[0] for g in _alias_groups(model) if merged.sources and g[0] in merged.sources]


def _shards(names: Sequence[str], sizes: Mapping[str, int], most: int) -> list[list[str]]:
    """``names`` in order, cut into runs of at most ``most`` bytes (a larger tensor alone)."""
    out: list[list[str]] = [[]]
    total = 0
    for name in names:
        if out[-1] and total + sizes[name] > most:
            out.append([])
            total = 0
        out[-1].append(name)
        total += sizes[name]
    return [s for s in out if s]


def _replace(path: Path, write: Any) -> Path:
    """``write(tmp)`` then rename onto ``path`` (:func:`runtime.files.atomic.write_atomic`): the file
    appears whole or not at all; a failure says why in one line, a full disk as such."""
    try:
        return write_atomic(path, write)
    except (WriteError, RuntimeError) as exc:  # (torch.save on a full disk: RuntimeError "unexpected pos")
        cause = exc.__cause__ if isinstance(exc, WriteError) else exc
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        strerror = cause.strerror if isinstance(cause, OSError) else None
        reason = disk_full(path.parent) or strerror or first
        raise RunError(f"cannot write {path}: {reason}; choose another -o") from exc


def _bytes(spec: TensorSpec) -> int:
    shape, dtype = spec
    numel = 1
    for n in shape:
        numel *= n
    return numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _shard_files(
    names: Sequence[str], tensors: Tensors, merged: Merged, folder: Path, stem: str, most: int
) -> Iterator[tuple[Path, list[str]]]:
    """(file, names) of each shard: ``stem.safetensors``, or ``stem-0000i-of-0000N.safetensors``."""
    assert merged.sources is not None
    sizes = {n: _bytes(tensors.specs[merged.sources[n]]) for n in names}
    shards = _shards(names, sizes, most)
    for i, shard in enumerate(shards):
        name = (
            f"{stem}.safetensors"
            if len(shards) == 1
            else f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        yield folder / name, shard


def write_safetensors(
    path: Path, model: nn.Module, tensors: Tensors, merged: Merged, most: int = MAX_SHARD_BYTES
) -> tuple[Path, list[Path]]:
    """Write the model's tensors as safetensors beside ``path`` (named after it); returns the file
    to load (the index when sharded) and the weight files."""
    from safetensors.torch import save_file

    assert merged.sources is not None
    names = _first_names(model, merged)
    stem, written, weight_map = path.name.removesuffix(".safetensors"), [], {}
    for file, shard in _shard_files(names, tensors, merged, path.parent, stem, most):
        got = tensors.read({merged.sources[n] for n in shard})
        data = {n: got[merged.sources[n]].contiguous() for n in shard}
        written.append(_replace(file, lambda tmp, d=data: save_file(d, str(tmp), metadata={"format": "pt"})))
        weight_map.update(dict.fromkeys(shard, file.name))
        del got, data
    if len(written) == 1:
        return written[0], written
    total = sum(_bytes(tensors.specs[merged.sources[n]]) for n in names)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    text = json.dumps(index, indent=2) + "\n"
    return _replace(path.parent / f"{stem}.safetensors.index.json", lambda tmp: tmp.write_text(text)), written


def write_state_dict(
    path: Path, pkg: ModuleType, model: nn.Module, tensors: Tensors, merged: Merged, seed: int
) -> Path:
    """``torch.save`` of the model's state_dict: every name, a tied tensor's names sharing storage,
    untrained tensors as ``full_model(seed)`` builds them (the whole model is in memory here)."""
    assert merged.sources is not None
    got = tensors.read(set(merged.sources.values()))
    spare = pkg.full_model(seed).state_dict() if merged.untrained else {}
    template = model.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    for group in _alias_groups(model):
        value = got[merged.sources[group[0]]] if group[0] in merged.sources else spare[group[0]]
        out.update(dict.fromkeys(group, value))
    state = type(template)((n, out[n]) for n in template)  # (an OrderedDict with load_state_dict's _metadata)
    state._metadata = getattr(template, "_metadata", None)  # type: ignore[attr-defined]
    return _replace(path, lambda tmp: torch.save(state, tmp))


def write_hf_folder(
    folder: Path, model: nn.Module, tensors: Tensors, merged: Merged, most: int
) -> list[Path]:
    """A folder ``from_pretrained`` reads: the model's config (and generation config), and the
    weights as safetensors shards with an index above ``most`` bytes."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        raise RunError(f"{type(model).__name__} has no Hugging Face config to save")
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    generation, can_generate = getattr(model, "generation_config", None), getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(folder)
    _, files = write_safetensors(folder / "model.safetensors", model, tensors, merged, most)
    return files


def export_checkpoint(
    package: str | Path,
    output: str | Path,
    step: int | None = None,
    checkpoint_dir: str | Path | None = None,
    hf_dir: str | Path | None = None,
    seed: int | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Exported:
    """Write ``step`` (default: the newest complete one) of a run of ``package``'s model to ``output``.

    Args:
        package: a package of the model (any plan of it: the checkpoint's names are the model's).
        output: ``*.safetensors``, or a state_dict file (``*.pt``).
        step: the checkpoint step; None: the newest complete one.
        checkpoint_dir: where the run wrote ``step-N/``; None: the newest run's ``checkpoints/``.
        hf_dir: for an ``hf:`` model, the ``from_pretrained`` folder; None: beside ``output``, named
            after it (``model.pt`` -> ``model-hf/``).
        seed: the seed of tensors no stage holds (state_dict files); None: the run's, else 0.
        max_shard_bytes: the largest safetensors file before sharding.

    Raises:
        RunError: no usable checkpoint, a step that is missing or incomplete, or a checkpoint that does
            not fit the package's model.
    """
    job = load_job(package)
    check_output(Path(output))
    root = Path(checkpoint_dir) if checkpoint_dir is not None else run_folder(package, None) / "checkpoints"
    chosen, skipped = choose_step(root, step)
    folder = checkpoint.step_dir(root, chosen)
    meta = (
        json.loads((folder / checkpoint.META).read_text(encoding="utf-8"))
        if (folder / checkpoint.META).is_file()
        else {}
    )
    seed = seed if seed is not None else int(meta.get("seed") or 0)
    pkg = import_package(job.package)
    if not callable(getattr(pkg, "full_model", None)):
        raise RunError(f"{job.package} has no full_model(); export needs a package of `pipeplan partition`")
    tensors = Tensors.open(folder, model_names(pkg, job))
    model = _meta_model(pkg, seed)
    merged = match_names(model, tensors.specs)
    merged = Merged(
        merged.loaded,
        merged.tied,
        merged.untrained,
        merged.dropped,
        _tie_difference(tensors, model),
        merged.sources,
    )
    out = Path(output)
    if out.suffix == ".safetensors":
        out, files = write_safetensors(out, model, tensors, merged, max_shard_bytes)
    else:
        files = [write_state_dict(out, pkg, model, tensors, merged, seed)]
    written_hf = None
    if job.model.startswith("hf:"):
        written_hf = Path(hf_dir) if hf_dir is not None else out.with_name(f"{out.name.split('.')[0]}-hf")
        files += write_hf_folder(written_hf, model, tensors, merged, max_shard_bytes)
    return Exported(chosen, out, tuple(files), written_hf, merged, skipped, seed)
