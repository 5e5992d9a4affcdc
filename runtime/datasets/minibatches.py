"""Minibatches by step number, identical on every rank that asks, so only the first stage reads inputs
and only the last reads targets, without sending either through the pipeline.

``synthetic`` draws from the package's ``example_inputs``/``example_targets`` under a seed derived from
the step (a fixed set of minibatches that repeats, so the loss falls as the model fits it). A user
spec ``module:fn`` or ``path/file.py:fn`` returns a Dataset or DataLoader of ``(input, target)``,
read in order unless ``shuffle`` (then shuffled per epoch from ``seed``, the same on every rank).
``imagefolder:DIR`` and ``text:FILE`` are read by :mod:`runtime.datasets.user_data` through the same replay.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from runtime.datasets.user_data import DataSettings, check_file_spec, file_loader, file_spec, is_file_spec
from runtime.errors import RunError
from runtime.executing.stage import Batches
from runtime.files.user_code import check_file, file_attr
from runtime.settings.run_options import RunOptions

__all__ = [
    "SYNTHETIC_STEPS",
    "DatasetBatches",
    "SyntheticBatches",
    "check_data_options",
    "check_data_spec",
    "constant_inputs",
    "make_batches",
]

_FORMS = "synthetic, module:function, path/file.py:function, imagefolder:DIR or text:FILE"

SYNTHETIC_STEPS = 8
"""Distinct synthetic minibatches; step ``s`` uses minibatch ``s % SYNTHETIC_STEPS`` (one epoch)."""

SYNTHETIC_KEEP_BYTES = 2**30
"""Synthetic minibatches are kept after their first draw while they fit in this many bytes: drawing is
not free (32 images of 3x224x224 take about 70 ms on one CPU thread, more than the training step they
feed on a GPU), and the same SYNTHETIC_STEPS minibatches come back every epoch."""


def _seed(seed: int) -> None:
    """Seed the CPU generator (and CUDA's where present). Not ``torch.manual_seed``: it also seeds the
    lazily initialised XPU and MTIA generators, recording a Python stack trace for each, which cost
    about 1 ms per minibatch on the first stage's critical path."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


class SyntheticBatches:
    """Random minibatches from the package's own example functions, seeded per step.

    A package whose ``example_inputs``/``example_targets`` take a ``seed`` (generated ones do) gets
    the step's seed for both, so targets derived from the inputs (next tokens) match them; older
    ones draw from torch's generator, seeded per step and kind. Each distinct minibatch is drawn once
    and kept while the kept ones fit in ``keep_bytes`` (the same values as drawing it again).
    """

    def __init__(
        self,
        package: ModuleType,
        names: Sequence[str],
        batch_size: int,
        seed: int,
        keep_bytes: int = SYNTHETIC_KEEP_BYTES,
    ) -> None:
        self.package, self.names, self.batch_size, self.seed = package, tuple(names), batch_size, seed
        self.keep_bytes = keep_bytes
        self.steps_per_epoch = SYNTHETIC_STEPS
        self._kept: dict[tuple[str, int], Any] = {}
        self._kept_bytes = 0
        self._takes_seed: dict[str, bool] = {}
        for attr in ("example_inputs", "example_targets"):
            fn = getattr(package, attr, None)
            if not callable(fn):
                raise RunError(f"the package defines no {attr}(batch_size); pass --data with training data")
            self._takes_seed[attr] = "seed" in inspect.signature(fn).parameters

    def _seeded(self, step: int, kind: int) -> int:
        return self.seed * 1_000_003 + (step % SYNTHETIC_STEPS) * 2 + kind

    def _call(self, attr: str, step: int, kind: int) -> Any:
        key = (attr, step % SYNTHETIC_STEPS)
        if key in self._kept:
            return self._kept[key]
        fn = getattr(self.package, attr)
        with torch.random.fork_rng(devices=[]):
            _seed(self._seeded(step, kind))
            drawn = (
                fn(self.batch_size, seed=self._seeded(step, 0))
                if self._takes_seed[attr]
                else fn(self.batch_size)
            )
        tensors = list(drawn.values()) if isinstance(drawn, Mapping) else [drawn]
        size = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        if self._kept_bytes + size <= self.keep_bytes:
            self._kept[key], self._kept_bytes = drawn, self._kept_bytes + size
        return drawn

    def inputs(self, step: int) -> tuple[torch.Tensor, ...]:
        found = self._call("example_inputs", step, 0)
        missing = [n for n in self.names if n not in found]
        if missing:
            raise RunError(f"example_inputs() lacks the first stage's inputs {missing}")
        return tuple(found[n] for n in self.names)

    def targets(self, step: int) -> torch.Tensor:
        return self._call("example_targets", step, 1)  # type: ignore[no-any-return]


class DatasetBatches:
    """Minibatches of a user DataLoader, replayed deterministically by step (for resume, too)."""

    def __init__(
        self,
        loader: DataLoader[Any],
        names: Sequence[str],
        seed: int,
        shuffle: bool,
        aliases: Mapping[str, str] | None = None,
        fills: Sequence[tuple[float, torch.dtype]] = (),
    ) -> None:
        self.loader, self.names, self.seed, self.shuffle = loader, tuple(names), seed, shuffle
        self.aliases, self.fills = dict(aliases or {}), tuple(fills)
        self.steps_per_epoch = len(loader)
        if self.steps_per_epoch < 1:
            raise RunError("the dataset yields no full minibatch; use a smaller --batch-size")
        self._iter: Iterator[Any] | None = None
        self._next = (-1, 0)
        self._cache: tuple[int, Any] = (-1, None)

    def _batch(self, step: int) -> Any:
        if self._cache[0] == step:
            return self._cache[1]
        epoch, index = divmod(step, self.steps_per_epoch)
        if self._iter is None or self._next[0] != epoch or self._next[1] > index:
            sampler = getattr(self.loader, "sampler", None)
            if self.shuffle and isinstance(sampler, RandomSampler) and sampler.generator is not None:
                sampler.generator.manual_seed(self.seed * 1_000_003 + epoch)
            self._iter, self._next = iter(self.loader), (epoch, 0)
        batch = None
        while self._next[1] <= index:
            batch = next(self._iter)
            self._next = (epoch, self._next[1] + 1)
        self._cache = (step, batch)
        return batch

    def inputs(self, step: int) -> tuple[torch.Tensor, ...]:
        x = self._batch(step)[0]
        if isinstance(x, Mapping):  # keyed by PipeDream's names (input0..) or the model's argument names
            return tuple(x[n] if n in x else x[self.aliases.get(n, n)] for n in self.names)
        got = tuple(x) if isinstance(x, (tuple, list)) else (x,)
        n = len(self.names)
        if got and len(got) < n <= len(self.fills) + 1:  # constant inputs the data lacks (masks)
            got += tuple(torch.full(got[0].shape, v, dtype=d) for v, d in self.fills[len(got) - 1 : n - 1])
        return got

    def targets(self, step: int) -> torch.Tensor:
        return self._batch(step)[1]  # type: ignore[no-any-return]


def constant_inputs(package: ModuleType, batch_size: int) -> tuple[tuple[float, torch.dtype], ...]:
    """(value, dtype) of the model's inputs after the first while each is a constant of the first's
    shape (a Hugging Face model's all-ones ``attention_mask``): what a file of tokens or images does
    not hold and a minibatch can be completed with. Stops at the first input that is not; none for a
    package without ``example_inputs`` (PipeDream's layout, hand-written ones)."""
    make = getattr(package, "example_inputs", None)
    if make is None:
        return ()
    made = make(batch_size)
    example = list(made.values()) if isinstance(made, Mapping) else list(made)
    out = []
    for t in example[1:]:
        flat = t.reshape(-1)
        if t.shape != example[0].shape or not flat.numel() or not bool((flat == flat[0]).all()):
            break
        out.append((flat[0].item(), t.dtype))
    return tuple(out)


def _load_factory(spec: str) -> Any:
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise RunError(f"--data {spec!r}: expected {_FORMS}")
    try:
        if where.endswith(".py"):
            return file_attr(where, attr, "--data file")()
        return getattr(importlib.import_module(where), attr)()
    except RunError:
        raise
    except Exception as exc:
        raise RunError(f"--data {spec}: {type(exc).__name__}: {exc}") from exc


def check_data_spec(spec: str) -> None:
    """Fail early, in the launcher, on a ``--data`` spec that names no file or module."""
    if spec == "synthetic" or is_file_spec(spec):
        return
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise RunError(f"--data {spec!r}: expected {_FORMS}")
    if where.endswith(".py"):
        check_file(where, "--data file")
        return
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise RunError(f"--data: no module named {where!r}")


def check_data_options(options: RunOptions) -> None:
    """Fail early, in the launcher, on ``--data``/``--eval-data`` specs that cannot be read, and on a data
    option that the chosen data would ignore."""
    specs = {"--data": options.data, **({"--eval-data": options.eval_data} if options.eval_data else {})}
    for option, spec in specs.items():
        check_data_spec(spec)
        check_file_spec(spec, DataSettings(options.seq_len, options.tokenizer), option)
    kinds = {found[0] for found in map(file_spec, specs.values()) if found is not None}
    if "text" not in kinds:
        for flag, value in (("--seq-len", options.seq_len), ("--tokenizer", options.tokenizer)):
            if value is not None:
                raise RunError(f"{flag} applies to text:FILE data only; give --data text:FILE or drop {flag}")
    if not kinds and options.data_workers != RunOptions.data_workers:
        raise RunError("--data-workers applies to imagefolder:DIR and text:FILE data only; drop it")
    if options.eval_every and options.eval_data is None:
        raise RunError("--eval-every needs --eval-data SPEC, the held-out data to evaluate")


def make_batches(
    spec: str,
    package: ModuleType,
    names: Sequence[str],
    batch_size: int,
    seed: int,
    shuffle: bool,
    settings: DataSettings | None = None,
) -> Batches:
    """The minibatch source named by ``--data``; ``settings`` serve ``imagefolder:`` and ``text:``."""
    if spec == "synthetic":
        return SyntheticBatches(package, names, batch_size, seed)
    if is_file_spec(spec):
        files = file_loader(spec, settings or DataSettings(), batch_size, seed, shuffle)
        return DatasetBatches(files, names, seed, shuffle, fills=constant_inputs(package, batch_size))
    made = _load_factory(spec)
    aliases = getattr(package, "TENSOR_NAMES", None)
    if isinstance(made, DataLoader):
        return DatasetBatches(made, names, seed, shuffle, aliases)
    if not isinstance(made, Dataset):
        raise RunError(f"--data {spec} returned {type(made).__name__}, not a Dataset or DataLoader")
    generator = torch.Generator().manual_seed(seed)
    sampler = RandomSampler(made, generator=generator) if shuffle else None  # type: ignore[arg-type]
    loader: DataLoader[Any] = DataLoader(made, batch_size=batch_size, sampler=sampler, drop_last=True)
    return DatasetBatches(loader, names, seed, shuffle, aliases)
