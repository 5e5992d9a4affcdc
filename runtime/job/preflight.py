"""What the launcher checks before any rank starts, so bad input fails in one line at second 1.

A rank that finds a broken stage file, a data function of the wrong shape or an unwritable output
path does so after the rendezvous, behind the elastic agent's logs, or (for a checkpoint folder or a
trace file) only at the first checkpoint or after the last step. Here the package is imported, one
minibatch drawn and every output folder written to, in the launcher, in seconds.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from runtime.building.weight_files import missing
from runtime.datasets.minibatches import make_batches
from runtime.datasets.user_data import DataSettings
from runtime.errors import RunError
from runtime.executing.tensor_parallel import check_degrees
from runtime.packages.job_config import JobConfig
from runtime.packages.load import import_package, read_wiring, reads_weights
from runtime.settings.run_options import RunOptions

__all__ = [
    "SPARE_BYTES",
    "check_first_stage",
    "check_inputs_match",
    "check_weights",
    "check_writable",
    "disk_full",
    "preflight",
]


def preflight(options: RunOptions, job: JobConfig, run_dir: Path) -> None:
    """Import the package, draw minibatch 0 and check its shapes, and write to every output folder.

    Raises:
        RunError: naming the file, option or tensor at fault.
    """
    check_writable(run_dir, "the run folder (--run-dir)")
    if options.checkpoint_dir:
        check_writable(Path(options.checkpoint_dir), "--checkpoint-dir")
    if options.trace:
        trace = Path(options.trace)
        if trace.is_dir():
            raise RunError(f"--trace {trace} is a folder; give a file name such as {trace / 'trace.json'}")
        check_writable(trace.parent, "--trace")
    _check_package_and_data(options, job)


SPARE_BYTES = 1 << 20
"""Free bytes below which a disk counts as full (logs, metrics and a small checkpoint need more)."""


def check_writable(folder: Path, what: str) -> None:
    """Create ``folder`` if needed and write data into it: an empty file still fits on a full disk."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder) as probe:
            probe.write(bytes(64 << 10))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        raise RunError(
            f"{what}: cannot write to {folder}: {exc.strerror or exc}; choose another folder"
        ) from exc
    full = disk_full(folder)
    if full:
        raise RunError(f"{what}: {full}; free space or choose another folder")


def disk_full(folder: Path) -> str | None:
    """``the disk holding FOLDER is full (N KiB free)`` when under :data:`SPARE_BYTES` are free."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if free >= SPARE_BYTES:
        return None
    return f"the disk holding {folder} is full ({free // 1024} KiB free)"


def _check_package_and_data(options: RunOptions, job: JobConfig) -> None:
    """Import the package fresh (and forget it again: the ranks import their own) and draw one batch
    of ``--data`` (and of ``--eval-data``, which must have the same sample shapes)."""
    before = set(sys.modules)
    try:
        package = import_package(job.package)
        wiring = read_wiring(package, job.stages, job.module_stages)
        names = wiring.stage_inputs[0]
        if options.weights:
            check_weights(package, options.weights, job)
        if job.is_3d:
            check_degrees(package, wiring, job)
        inputs = _first_minibatch(options.data, options, job, package, names)
        if list(job.module_stages).count(0) <= 1:  # one module on stage 0 (PipeDream's may chain several)
            check_first_stage(package, inputs, options.data)
        if options.eval_data is not None:
            held_out = _first_minibatch(options.eval_data, options, job, package, names, "--eval-data")
            for name, a, b in zip(names, inputs, held_out, strict=True):
                if a.shape != b.shape:
                    raise RunError(
                        f"--eval-data {options.eval_data}: input {name} has shape {tuple(b.shape)}, --data "
                        f"{tuple(a.shape)}; the pipeline sends fixed shapes, so give both the same"
                    )
    finally:
        for name in set(sys.modules) - before:
            if name.startswith("pipeplan_pkg_"):
                del sys.modules[name]


def check_weights(package: ModuleType, weights: str, job: JobConfig) -> None:
    """``--weights`` must hold every parameter of every stage (a tied one under any of its names),
    and the package must be one whose stages read them; only the names are read here."""
    if not reads_weights(package):
        raise RunError(
            f"{job.package} was written before packages took --weights; regenerate it: pipeplan partition"
        )
    with torch.device("meta"):
        entries = package.model(package.criterion())
    partners = {member: [name for _, name in tie] for tie in job.ties for member in tie}
    owners = list(job.module_stages) or list(range(job.stages))
    tensors = [
        partners.get((stage, name), [name])
        for (module, _, _), stage in zip(entries[:-1], owners, strict=False)
        for name, _ in module.named_parameters()
    ]
    try:
        gaps = missing(weights, tensors)
    except (OSError, ValueError, RuntimeError) as exc:
        raise RunError(f"--weights {weights}: {exc}") from exc
    if gaps:
        raise RunError(
            f"--weights {weights} lacks {len(gaps)} of the model's parameters, e.g. {gaps[0]}; give this "
            "model's weights (save_pretrained, or torch.save(model.state_dict()))"
        )


def _first_minibatch(
    spec: str,
    options: RunOptions,
    job: JobConfig,
    package: ModuleType,
    names: Sequence[str],
    option: str = "--data",
) -> Sequence[torch.Tensor]:
    """Minibatch 0 of ``spec``'s inputs, checked against the plan, and its targets' rows."""
    settings = DataSettings.of(options, job)
    batches = make_batches(spec, package, names, job.batch_size, options.seed, options.shuffle, settings)
    try:
        inputs, targets = batches.inputs(0), batches.targets(0)
    except RunError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RunError(f"{option} {spec}: minibatch 0 failed: {type(exc).__name__}: {first}") from exc
    aliases = getattr(package, "TENSOR_NAMES", {})  # input0.. -> the model's argument names
    check_inputs_match([aliases.get(n, n) for n in names], inputs, job.inputs, job.batch_size, spec)
    if not isinstance(targets, torch.Tensor) or targets.shape[:1] != (job.batch_size,):
        got = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise RunError(f"{option} {spec}: targets of minibatch 0 are {got}, not {job.batch_size} rows")
    return inputs


def check_inputs_match(
    names: Sequence[str], inputs: Sequence[Any], planned: Sequence[dict[str, Any]], batch_size: int, data: str
) -> None:
    """Minibatch 0's first-stage inputs are tensors of ``batch_size`` rows, with the rank and dtype
    plan.json recorded for them (the sample's own sizes may differ, e.g. a shorter sequence)."""
    if len(inputs) != len(names):
        hint = (
            "; a text or image file gives the first input (and inputs that are constants, as an "
            "attention mask) only: give the others with --data module:function"
            if data.startswith(("text:", "imagefolder:"))
            else ""
        )
        raise RunError(
            f"--data {data}: minibatch 0 has {len(inputs)} inputs; the first stage reads {list(names)}{hint}"
        )
    recorded = {str(p.get("name")): p for p in planned}
    for name, tensor in zip(names, inputs, strict=True):
        if not isinstance(tensor, torch.Tensor):
            raise RunError(f"--data {data}: input {name} is a {type(tensor).__name__}, not a tensor")
        shape, dtype = tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")
        want = recorded.get(name, {})
        rank = len(want.get("shape", shape))
        if shape[:1] != (batch_size,) or len(shape) != rank:
            expected = (
                f"({batch_size}, {', '.join(map(str, want['shape'][1:]))})" if want else f"{batch_size} rows"
            )
            raise RunError(f"--data {data}: input {name} has shape {shape}, the package expects {expected}")
        if want.get("dtype", dtype) != dtype:
            raise RunError(f"--data {data}: input {name} is {dtype}, the package expects {want['dtype']}")
        limit = want.get("max_length")
        if limit and len(shape) > 1 and shape[1] > limit:
            raise RunError(
                f"--data {data}: input {name} holds {shape[1]} positions, the model has {limit}; "
                f"give --seq-len {limit} or less"
            )


def check_first_stage(package: ModuleType, inputs: Sequence[torch.Tensor], data: str) -> None:
    """Run the first stage on minibatch 0 on the meta device: shapes are checked, nothing is computed."""
    with torch.device("meta"):
        first = package.model(package.criterion())[0][0]
        try:
            first(*(t.to("meta") for t in inputs))
        except NotImplementedError:  # an operator without a meta kernel: the ranks will tell
            return
        except Exception as exc:
            if "meta" in str(exc).lower():  # data-dependent code (.item(), nonzero): not checkable here
                return
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
            raise RunError(
                f"--data {data}: the first stage cannot read minibatch 0 of shape {shapes}: "
                f"{type(exc).__name__}: {first_line}"
            ) from exc
