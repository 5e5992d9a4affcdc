"""Data a user has on disk: ``imagefolder:DIR`` and ``text:FILE`` specs, read through a DataLoader.

Both become a :class:`torch.utils.data.DataLoader` (``drop_last``, worker processes, shuffling from
the run's seed) that :class:`runtime.datasets.minibatches.DatasetBatches` replays by step, so every rank that
reads inputs or targets sees the same minibatches in the same order. What the package expects (the input
sample's shape and dtype, its number of output classes) comes from plan.json, and data that cannot
fit it (more class folders than outputs, token ids beyond the vocabulary) is refused in one line.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from runtime.errors import RunError
from runtime.packages.job_config import JobConfig
from runtime.settings.run_options import RunOptions

__all__ = [
    "FILE_KINDS",
    "DataSettings",
    "check_file_spec",
    "file_loader",
    "file_spec",
    "is_file_spec",
    "output_classes",
]

FILE_KINDS = ("imagefolder", "text")


@dataclass(frozen=True)
class DataSettings:
    """What reading a file spec needs besides the spec itself.

    Attributes:
        seq_len: tokens per window of ``text:`` data.
        tokenizer: a local Hugging Face tokenizer folder; None: bytes.
        workers: DataLoader worker processes of each rank that reads data (0: the rank itself).
        sample_shape: one input sample's shape from plan.json (batch dimension dropped); None: unknown.
        input_dtype: the first input's dtype from plan.json.
        classes: the package's output classes (its vocabulary for a language model); None: unknown.
        mask_token: for a masked-lm package (plan.json's targets of kind ``masked``), the token that
            hides the positions it is scored on; ``text:`` windows are then masked as its synthetic
            data are (:func:`runtime.datasets.text_windows.mask_tokens`), not given the next tokens it could
            copy.
    """

    seq_len: int | None = None
    tokenizer: str | None = None
    workers: int = 0
    sample_shape: tuple[int, ...] | None = None
    input_dtype: str = "float32"
    classes: int | None = None
    mask_token: int | None = None

    @staticmethod
    def of(options: RunOptions, job: JobConfig) -> DataSettings:
        first = job.inputs[0] if job.inputs else {}
        shape = first.get("shape")
        return DataSettings(
            seq_len=options.seq_len,
            tokenizer=options.tokenizer,
            workers=options.data_workers,
            sample_shape=tuple(int(s) for s in shape[1:]) if shape else None,
            input_dtype=str(first.get("dtype", "float32")),
            classes=output_classes(job),
            mask_token=_mask_token(job),
        )


def _mask_token(job: JobConfig) -> int | None:
    targets = job.targets or {}
    return int(targets["mask_token"]) if targets.get("kind") == "masked" and "mask_token" in targets else None


def output_classes(job: JobConfig) -> int | None:
    """The width of the model's output as plan.json records it: the classes of class targets, or the
    vocabulary of next-token targets (the first input's id range); None when not recorded."""
    targets = job.targets or {}
    if targets.get("kind") in ("classes", "masked", "shifted") and targets.get("high") is not None:
        return int(targets["high"])
    if targets.get("kind") == "next_token" and job.inputs and job.inputs[0].get("high") is not None:
        return int(job.inputs[0]["high"])
    return None


def file_spec(spec: str) -> tuple[str, str] | None:
    """``(kind, path)`` of an ``imagefolder:DIR`` or ``text:FILE`` spec; None for other specs."""
    kind, sep, path = spec.partition(":")
    return (kind, path) if sep and kind in FILE_KINDS else None


def is_file_spec(spec: str) -> bool:
    """True for ``imagefolder:...`` and ``text:...`` (checked before ``module:fn``, which they resemble)."""
    return file_spec(spec) is not None


def check_file_spec(spec: str, settings: DataSettings, option: str = "--data") -> None:
    """Fail in the launcher, in one line, on a file spec that cannot be read (cheap checks only:
    folders and files exist, options it needs are given, Pillow or transformers are installed)."""
    found = file_spec(spec)
    if found is None:
        return
    kind, path = found
    if not path:
        raise RunError(f"{option} {spec}: give a path after '{kind}:'")
    if kind == "text":
        if settings.seq_len is None:
            raise RunError(f"{option} {spec} needs --seq-len N, the tokens per training window")
        if not Path(path).is_file():
            raise RunError(f"{option} {spec}: no such file")
        return
    from runtime.datasets.imagefolder import find_images, require_pillow

    require_pillow()
    find_images(path)


def _dataset(kind: str, path: str, settings: DataSettings, batch_size: int) -> Dataset[Any]:
    if kind == "imagefolder":
        from runtime.datasets.imagefolder import ImageFolder

        if settings.sample_shape is None:
            raise RunError("--data imagefolder: plan.json records no input shape to resize the images to")
        images = ImageFolder(path, settings.sample_shape, getattr(torch, settings.input_dtype))
        if settings.classes is not None and len(images.classes) > settings.classes:
            raise RunError(
                f"--data imagefolder:{path} has {len(images.classes)} class folders but the model has "
                f"{settings.classes} outputs; profile a model with {len(images.classes)} classes"
            )
        return images
    from runtime.datasets.text_windows import BYTE_VOCAB, MaskedWindows, TokenWindows, load_tokens

    if settings.seq_len is None:
        raise RunError(f"--data text:{path} needs --seq-len N")
    tokens = load_tokens(path, settings.tokenizer)
    vocab = settings.classes
    if vocab is not None and tokens.numel() and int(tokens.max()) >= vocab:
        what = (
            f"--tokenizer {settings.tokenizer}" if settings.tokenizer else f"bytes (vocabulary {BYTE_VOCAB})"
        )
        raise RunError(
            f"--data text:{path}: token id {int(tokens.max())} from {what} does not fit the model's "
            f"vocabulary of {vocab}; profile a model with a vocabulary of at least {int(tokens.max()) + 1}"
        )
    windows = TokenWindows(tokens, settings.seq_len)
    if len(windows) < batch_size:
        raise RunError(
            f"--data text:{path}: {tokens.numel()} tokens make {len(windows)} windows of --seq-len "
            f"{settings.seq_len}, fewer than one minibatch of {batch_size}; use a longer text or a "
            "smaller --seq-len or --batch-size"
        )
    return windows if settings.mask_token is None else MaskedWindows(windows, settings.mask_token)


def file_loader(
    spec: str, settings: DataSettings, batch_size: int, seed: int, shuffle: bool
) -> DataLoader[Any]:
    """A DataLoader of full minibatches of a file spec. Its own generators (seeded from ``seed``) shuffle
    and seed the workers, so reading data never draws from torch's global generator (dropout's)."""
    found = file_spec(spec)
    if found is None:
        raise RunError(f"not a file spec: {spec!r}")
    dataset = _dataset(*found, settings, batch_size)
    if len(dataset) < batch_size:  # type: ignore[arg-type]
        raise RunError(
            f"--data {spec}: {len(dataset)} samples, fewer than one minibatch of {batch_size}; "  # type: ignore[arg-type]
            "use a smaller --batch-size"
        )
    generator = torch.Generator().manual_seed(seed)
    # Workers fork from the rank: ranks start under forkserver, whose default would start each rank's
    # workers from a fresh interpreter that imports torch again (seconds per rank, on the first batch).
    forks = settings.workers > 0 and "fork" in multiprocessing.get_all_start_methods()
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)) if shuffle else None  # type: ignore[arg-type]
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=settings.workers,
        persistent_workers=settings.workers > 0,
        multiprocessing_context="fork" if forks else None,
        generator=generator,
    )
