"""The options of one training run, shared by the launcher, every rank and the torchrun command line.

The same frozen :class:`RunOptions` reaches each rank whether it was started by
:func:`runtime.job.launch.launch` (pickled to the workers) or by ``torchrun -m runtime.job.worker ...`` on
another node (parsed back from :func:`to_argv`'s arguments).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from runtime.executing.optimizer import OptimSettings

__all__ = ["RunOptions", "flat_fields", "from_argv", "to_argv"]


@dataclass(frozen=True)
class RunOptions:
    """How to train a package.

    Attributes:
        package: folder of the generated package.
        steps: minibatches to train in total (counting those before a resume); None: use ``epochs``.
        epochs: passes over the data when ``steps`` is None.
        batch_size: samples per minibatch; None: plan.json's.
        microbatches: microbatches per minibatch; None: plan.json's.
        schedule: pipedream, 1f1b or gpipe; None: plan.json's.
        backend: auto (nccl on CUDA, else gloo), gloo or nccl.
        data: ``synthetic``, a ``module:fn`` / ``file.py:fn`` spec of a Dataset or DataLoader,
            ``imagefolder:DIR`` or ``text:FILE`` (see :mod:`runtime.datasets.user_data`).
        seq_len: tokens per window of ``text:`` data.
        tokenizer: a local Hugging Face tokenizer folder for ``text:`` data; None: bytes.
        data_workers: DataLoader worker processes per reading rank for ``imagefolder:``/``text:`` data.
        eval_data: held-out data (any ``data`` form) evaluated forward-only; None: no evaluation.
        eval_every: evaluate every this many steps (0: only at the end), with ``eval_data``.
        optim: the optimizer, its learning-rate schedule and clipping
            (:class:`runtime.executing.optimizer.OptimSettings`, checked when made; :meth:`RunOptions.of`
            takes its fields flat, as the command line does).
        precision: fp32, bf16 or fp16 (autocast; fp16 with dynamic loss scaling); None: plan.json's.
        seed: seeds weights, synthetic data and shuffling.
        weights: initial weights instead of the package's: a state_dict file, a ``.safetensors``
            file or a ``save_pretrained`` folder; each rank reads only its stage's tensors.
        shuffle: shuffle a user dataset each epoch.
        checkpoint_dir: where the ``step-N/`` checkpoints go (:mod:`runtime.checkpoints.step_folders`);
            None: none.
        checkpoint_every: checkpoint every this many steps (0: only at the end).
        checkpoint_async: write checkpoints in the background (``dcp.async_save``): training goes on
            once each rank has copied its tensors.
        keep_checkpoints: keep only the newest this many steps (0: all), plus pinned ones.
        pin_every: never delete steps that are multiples of this (0: none).
        resume: continue from the newest complete checkpoint in ``checkpoint_dir``.
        accept_changes: with ``resume``, continue even where the run's settings differ from the
            checkpoint's (each change is named); without it such a resume is refused.
        trace: path of a merged Chrome trace to write; None: no trace.
        tensorboard: a folder for TensorBoard event files (one run per rank); None: none.
        peak_tflops: one device's peak dense TFLOP/s at the run's precision, for the model FLOP
            utilisation (MFU); None: known GPUs' spec-sheet figure, no MFU elsewhere.
        measure_memory: on a CPU, measure each rank's peak tensor memory by counting the storages
            its operators make (:mod:`runtime.observing.peak_memory`; opt-in: a Python call per operator).
        timeout: seconds any rank waits for another before the job fails.
        run_dir: where metrics.json and progress go (default: ``<package>/run``).
        nnodes: machines in the job.
        node_rank: this machine's index.
        master_addr: host of node 0.
        master_port: port of node 0's rendezvous store (0: pick a free one, single node only).
        start_method: how local workers start: forkserver (default: torch imported once, ranks forked
            from a single-threaded server), spawn (a fresh interpreter per rank, like torchrun) or fork
            (fastest, but may deadlock a rank; see runtime.job.launch).
        resume_step: with ``resume``, the step the launcher chose to continue after (0: none usable,
            start afresh); None: rank 0 chooses (ranks started by torchrun).
        launcher_pid: the process every rank dies with (set by :func:`runtime.job.launch.launch`; 0: the
            rank's parent, the torchrun agent).
    """

    package: str
    steps: int | None = None
    epochs: int | None = None
    batch_size: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    backend: str = "auto"
    data: str = "synthetic"
    seq_len: int | None = None
    tokenizer: str | None = None
    data_workers: int = 1
    eval_data: str | None = None
    eval_every: int = 0
    optim: OptimSettings = field(default_factory=OptimSettings)
    precision: str | None = None
    seed: int = 0
    weights: str | None = None
    shuffle: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_async: bool = False
    keep_checkpoints: int = 0
    pin_every: int = 0
    resume: bool = False
    accept_changes: bool = False
    trace: str | None = None
    tensorboard: str | None = None
    peak_tflops: float | None = None
    measure_memory: bool = False
    timeout: float = 60.0
    run_dir: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    start_method: str = "forkserver"
    launcher_pid: int = 0
    resume_step: int | None = None

    @classmethod
    def of(cls, package: str, **flat: Any) -> RunOptions:
        """RunOptions from flat keyword arguments, as the command line and run.toml name them: the
        optimizer's (``lr=0.1``) go into :attr:`optim`."""
        names = OptimSettings.__dataclass_fields__
        optim = OptimSettings(**{k: flat.pop(k) for k in list(flat) if k in names})
        return cls(package, **flat, optim=optim)


_LAUNCH_ONLY = {"nnodes", "node_rank", "master_addr", "master_port", "start_method", "launcher_pid"}


def flat_fields(options: RunOptions) -> Iterator[tuple[Any, Any]]:
    """(field, value) of every option, the optimizer's settings among them as if they were the run's
    own: the flat view the command line, the torchrun arguments and run.toml share."""
    for f in fields(options):
        if f.name == "optim":
            yield from ((g, getattr(options.optim, g.name)) for g in fields(options.optim))
        else:
            yield f, getattr(options, f.name)


def to_argv(options: RunOptions) -> list[str]:
    """Arguments of ``python -m runtime.job.worker`` that rebuild ``options`` (launch-only fields left
    out)."""
    argv = [options.package]
    for f, value in flat_fields(options):
        if f.name == "package" or f.name in _LAUNCH_ONLY or value is None or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        argv += [flag] if value is True else [flag, text]
    return argv


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split(","))


def from_argv(argv: Sequence[str]) -> RunOptions:
    """Parse :func:`to_argv`'s arguments."""
    parser = argparse.ArgumentParser(prog="python -m runtime.job.worker")
    parser.add_argument("package")
    every = [f for f in fields(RunOptions) if f.name != "optim"] + list(fields(OptimSettings))
    for f in every:
        if f.name == "package" or f.name in _LAUNCH_ONLY:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.default is False:
            parser.add_argument(flag, action="store_true")
        else:
            kinds: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "tuple[float,": _floats}
            kind = kinds.get(str(f.type).split(" ")[0], str)
            parser.add_argument(flag, type=kind, default=f.default)
    flat = vars(parser.parse_args(list(argv)))
    return RunOptions.of(flat.pop("package"), **flat)
