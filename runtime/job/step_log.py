"""One JSON line per step per rank, that a user can ``tail -f``; TensorBoard scalars when asked.

``PACKAGE/run/steps/rank<R>.jsonl`` (the run folder's), one object per minibatch, written and flushed
as the step ends:

- ``step`` (1-based), ``rank``, ``stages`` (the stages the rank runs), ``time`` (Unix seconds);
- ``step_s``: the rank's wall seconds for this minibatch (a pipedream round shares its time among its
  minibatches); ``samples_per_s`` and, for models whose first input is token ids, ``tokens_per_s``;
- ``compute_s``, ``comm_s`` (blocked in receives, sends and all-reduces) and ``idle_s`` (the rest);
- ``memory_bytes``: on a GPU the bytes torch has allocated, ``peak_memory_bytes`` its peak so far;
  on a CPU the process's resident set (tensors, interpreter and libraries);
- ``lr`` (the rate this minibatch's update used), ``loss_scale`` (fp16), ``loss`` (last stage);
- ``mfu`` where the model's FLOPs and the device's peak are known (:mod:`runtime.observing.flops`).

With ``--tensorboard DIR`` the same numbers go to ``DIR/rank<R>/`` through
``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package must be installed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runtime.errors import RunError
from runtime.executing.comm import peer_errors
from runtime.executing.optimizer import lr_factor
from runtime.executing.stage import StageRuntime
from runtime.observing.flops import minibatch_flops, peak_flops, token_count
from runtime.observing.resident_memory import resident_bytes
from runtime.packages.load import import_package
from runtime.settings.run_options import RunOptions

__all__ = ["StepLog", "check_tensorboard", "open_step_log", "open_writer"]


def check_tensorboard() -> None:
    """Raise the RunError :func:`open_writer` would, before any rank starts."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        open_writer("", 0)


def open_writer(folder: str, rank: int) -> Any:
    """TensorBoard's ``SummaryWriter`` for this rank's run under ``folder``.

    Raises:
        RunError: tensorboard is not installed.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise RunError(
            "--tensorboard needs the tensorboard package: pip install 'pipeplan[tensorboard]' (or "
            "tensorboard); every rank's steps are in PACKAGE/run/steps/rankR.jsonl without it"
        ) from exc
    return SummaryWriter(log_dir=str(Path(folder) / f"rank{rank}"))


@dataclass
class StepLog:
    """The step lines of one rank.

    Attributes:
        path: the JSONL file.
        rank: this rank.
        stages: the stages it runs.
        batch_size: samples per minibatch.
        tokens: tokens per minibatch (None: the model reads no token ids).
        lr: the learning rate that minibatch ``s`` (0-based) used.
        busy: cumulative (compute, communication) seconds of the rank so far.
        device: the rank's device.
        flops: the model's FLOPs per minibatch (None: unknown).
        peak: one device's peak FLOP/s (None: unknown).
        devices: devices of the job (MFU divides by all of them).
        loss_scale: fp16's current scale (None otherwise).
        writer: a TensorBoard SummaryWriter, or None.
    """

    path: Path
    rank: int
    stages: tuple[int, ...]
    batch_size: int
    tokens: int | None
    lr: Callable[[int], float]
    busy: Callable[[], tuple[float, float]]
    device: torch.device
    flops: int | None = None
    peak: float | None = None
    devices: int = 1
    loss_scale: Callable[[], float | None] = lambda: None
    writer: Any = None
    _last: tuple[float, float] = (0.0, 0.0)
    _handle: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = self.path.open("a", encoding="utf-8")
        self._last = self.busy()

    def _memory(self) -> dict[str, int | None]:
        if self.device.type == "cuda":
            return {
                "memory_bytes": torch.cuda.memory_allocated(self.device),
                "peak_memory_bytes": torch.cuda.max_memory_allocated(self.device),
            }
        return {"memory_bytes": resident_bytes()}

    def record(self, steps: tuple[int, ...], seconds: float, losses: tuple[float, ...] | None) -> None:
        """An optimizer step covering ``steps`` (0-based) ended after ``seconds`` of wall time."""
        compute, comm = self.busy()
        share = 1.0 / len(steps)
        d_compute, d_comm = (compute - self._last[0]) * share, (comm - self._last[1]) * share
        self._last = (compute, comm)
        each = seconds * share
        for i, step in enumerate(steps):
            line: dict[str, Any] = {
                "step": step + 1, "rank": self.rank, "stages": list(self.stages), "time": time.time(),
                "step_s": each, "samples_per_s": self.batch_size / each if each > 0 else None,
                "compute_s": d_compute, "comm_s": d_comm, "idle_s": max(0.0, each - d_compute - d_comm),
                **self._memory(), "lr": self.lr(step), "loss_scale": self.loss_scale(),
            }  # fmt: skip
            if self.tokens is not None:
                line["tokens_per_s"] = self.tokens / each if each > 0 else None
            if losses and i < len(losses):
                line["loss"] = losses[i]
            if self.flops is not None and self.peak is not None and each > 0:
                line["mfu"] = self.flops / (each * self.devices * self.peak)
            self._handle.write(json.dumps(line) + "\n")
            self._handle.flush()
            if self.writer is not None:
                self._scalars(line)

    def _scalars(self, line: dict[str, Any]) -> None:
        step = int(line["step"])
        for key, value in line.items():
            if key not in ("step", "rank", "stages", "time") and isinstance(value, int | float):
                self.writer.add_scalar(key, value, step, walltime=line["time"])

    def summary(self, time_per_minibatch_s: float | None) -> dict[str, Any]:
        """The run's rates for metrics.json, at its median time per minibatch."""
        t = time_per_minibatch_s
        return {
            "tokens_per_minibatch": self.tokens,
            "tokens_per_s": self.tokens / t if self.tokens is not None and t else None,
            "model_flops_per_minibatch": self.flops,
            "peak_flops_per_device": self.peak,
            "mfu": self.flops / (t * self.devices * self.peak) if self.flops and self.peak and t else None,
        }

    def close(self) -> None:
        self._handle.close()
        if self.writer is not None:
            self.writer.close()


def _model_rates(rt: StageRuntime) -> tuple[int | None, int | None]:
    """(model FLOPs, tokens) of a minibatch, counted by rank 0 (it reads the inputs) for every rank."""
    found: list[Any] = [(None, None)]
    if rt.cfg.rank == 0:
        job = rt.cfg.job
        inputs, targets = rt.batches.inputs(0), rt.batches.targets(0)
        flops = minibatch_flops(import_package(job.package), rt.wiring, job.module_stages, inputs, targets)
        found = [(flops, token_count(inputs))]
    with peer_errors("sharing the model's FLOP count"):
        dist.broadcast_object_list(found, src=0)
    return found[0]  # type: ignore[no-any-return]


def open_step_log(options: RunOptions, hosted: tuple[StageRuntime, ...], folder: Path, total: int) -> StepLog:
    """This rank's step log under ``folder`` (every rank calls it together: rank 0 counts the FLOPs)."""
    rt = hosted[-1]
    job, settings = rt.cfg.job, options.optim
    flops, tokens = _model_rates(hosted[0])

    def lr(step: int) -> float:
        return settings.lr * lr_factor(step, settings.lr_schedule, settings.warmup_steps, total)

    def busy() -> tuple[float, float]:
        return rt.recorder.seconds["compute"], rt.comm.seconds

    scaler = rt.scaler
    return StepLog(
        folder / "steps" / f"rank{rt.cfg.rank}.jsonl",
        rt.cfg.rank,
        tuple(each.cfg.stage for each in hosted),
        job.batch_size,
        tokens,
        lr,
        busy,
        rt.comm.device,
        flops,
        peak_flops(rt.comm.device, job.precision, options.peak_tflops),
        job.world_size,
        (lambda: scaler.scale) if scaler is not None else (lambda: None),
        open_writer(options.tensorboard, rt.cfg.rank) if options.tensorboard else None,
    )
