"""The profiler: model spec -> traced layers -> measured ``Profile``.

Example:
    >>> profile = profile_model("tiny-mlp", batch_size=4, repeats=1)
    >>> [n.id for n in profile.nodes][:3]
    ['x', 'fc1', 'act1']
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, fx, nn

from partitioner.errors import PipeplanError, TraceError
from partitioner.graph import Node, Profile, TensorSpec, scale_batch
from partitioner.models import ModelBundle, load_model
from partitioner.profiler.fixed import measure_fixed
from partitioner.profiler.measure import (
    LayerCost,
    LayerProfiler,
    StepCost,
    getattr_path,
    measure_loss,
    measure_step,
)
from partitioner.profiler.trace import Group, Traced, trace_model
from partitioner.profiler.update import measure_update
from partitioner.update import UPDATE_KEY
from runtime.precision import PRECISIONS

__all__ = ["check_precision_options", "profile_model", "resolve_device", "resolve_dtype"]

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; an unavailable cuda is a user error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise PipeplanError(f"unknown device {device!r}: use auto, cpu or cuda") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise PipeplanError("--device cuda asked for, but this torch has no usable GPU; use --device cpu")
    return resolved


def resolve_dtype(dtype: str) -> torch.dtype:
    """``float32``/``fp32``, ``float16``/``fp16``/``half``, ``bfloat16``/``bf16``."""
    names = {
        "float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "float16": torch.float16,
        "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    }  # fmt: skip
    if dtype not in names:
        raise PipeplanError(f"unknown dtype {dtype!r}: use float32, float16 or bfloat16")
    return names[dtype]


def check_precision_options(precision: str, dtype: str = "float32") -> None:
    """A PipeplanError for an unknown precision, or one combined with low-precision weights."""
    if precision not in PRECISIONS:
        raise PipeplanError(f"unknown --precision {precision!r}: use {', '.join(PRECISIONS)}")
    if precision != "fp32" and resolve_dtype(dtype) != torch.float32:
        raise PipeplanError(
            f"--precision {precision} keeps float32 weights and computes under autocast; --dtype {dtype} "
            "makes the weights themselves low-precision: give one of the two"
        )


def profile_model(
    spec: str,
    batch_size: int = 1,
    input_shape: tuple[int, ...] | None = None,
    device: str = "auto",
    dtype: str = "float32",
    leaf_modules: Sequence[str] = (),
    repeats: int = 3,
    progress: Progress | None = None,
    clock: str = "wall",
    threads: int | None = None,
    microbatch_size: int | None = None,
    precision: str = "fp32",
    fixed_cost: bool = True,
) -> Profile:
    """Trace ``spec`` and measure every layer at ``batch_size``; see ``partitioner.graph.Profile``.

    Args:
        spec: model spec (``vgg16``, ``torchvision:resnet50``, ``pkg.mod:fn``, ``file.py:fn``).
        batch_size: samples per minibatch the times refer to.
        input_shape: shape of one sample, overriding the model's default.
        device: ``auto``, ``cpu`` or ``cuda``.
        dtype: parameter and float-input dtype.
        leaf_modules: classes kept as one layer each.
        repeats: timed runs per layer (after one warm-up); the median is kept.
        progress: called as ``progress(done, total, layer_name)`` after each layer.
        clock: ``wall`` (elapsed time) or ``cpu`` (process CPU time, robust to other jobs on a shared
            CPU; its times add all threads' work, so they exceed wall time when threads run in parallel).
        threads: CPU threads while measuring (restored after); ``pipeplan run`` gives each rank
            cores / local ranks, so a profile taken at that count predicts what the ranks will do.
            Default on a CPU: 1 (what a rank gets as soon as a machine runs as many ranks as cores).
        microbatch_size: measure at this many samples and scale the times to ``batch_size``: what
            a stage of a 1f1b or gpipe pipeline with batch_size / microbatch_size microbatches runs.
        precision: ``fp32``, or ``bf16``/``fp16``: every forward and the loss under autocast to that
            type, float32 weights (what ``pipeplan run --precision`` trains with).
        fixed_cost: also measure every layer at an eighth of the batch, for each layer's fixed time
            per call (:mod:`partitioner.profiler.fixed`): what prices one microbatch count against
            another. A second pass, at an eighth of the samples.

    Raises:
        PipeplanError: bad spec, shapes, device or dtype; TraceError when the model cannot be traced.
    """
    if repeats <= 0:
        raise PipeplanError(f"--repeats must be positive, got {repeats}")
    if clock not in ("wall", "cpu"):
        raise PipeplanError(f"unknown clock {clock!r}: use wall or cpu")
    if threads is not None and threads <= 0:
        raise PipeplanError(f"--threads must be positive, got {threads}")
    check_precision_options(precision, dtype)
    if microbatch_size is not None and not 0 < microbatch_size <= batch_size:
        raise PipeplanError(f"--microbatch-size must be between 1 and --batch-size {batch_size}")
    measured = microbatch_size or batch_size
    previous = torch.get_num_threads()
    if threads is None and resolve_device(device).type == "cpu":
        threads = 1  # a CPU rank of `pipeplan run` gets cores / ranks threads: one as soon as ranks >= cores
    torch.set_num_threads(threads or previous)
    try:
        profile = _profile(
            spec, measured, input_shape, device, dtype, leaf_modules, repeats, progress, clock, precision,
            fixed_cost,
        )  # fmt: skip
    finally:
        torch.set_num_threads(previous)
    return scale_batch(profile, batch_size) if measured != batch_size else profile


def _profile(
    spec: str,
    batch_size: int,
    input_shape: tuple[int, ...] | None,
    device: str,
    dtype: str,
    leaf_modules: Sequence[str],
    repeats: int,
    progress: Progress | None,
    clock: str,
    precision: str = "fp32",
    fixed_cost: bool = True,
) -> Profile:
    """profile_model's work, under the thread count it set."""
    started, load_before = time.perf_counter(), _load()
    where, param_dtype = resolve_device(device), resolve_dtype(dtype)
    if clock == "cpu" and where.type != "cpu":
        raise PipeplanError("--clock cpu measures CPU time: it only applies to --device cpu")
    bundle = _placed(load_model(spec, batch_size, input_shape), where, param_dtype)
    traced = trace_model(bundle, leaf_modules, input_shape)
    gm = traced.graph_module
    try:
        # The step runs the traced graph, the code the pipeline stages are cut from (for fx, the model's own
        # modules; for export, its aten ops without the Python around them). Its samples bracket the layer
        # measurements, so both see the same machine load.
        inputs = dict(zip(bundle.input_names, bundle.inputs, strict=True)) if bundle.input_names else None
        step_args = (gm, inputs or bundle.inputs, bundle.targets, bundle.loss_fn)
        before = measure_step(*step_args, repeats=1, warmup=1, clock=clock, precision=precision)
        profiler = LayerProfiler(
            gm, traced.groups, repeats=repeats, progress=progress, clock=clock, precision=precision
        )
        costs = profiler.profile(*bundle.inputs)
        loss_ms = measure_loss(
            profiler.result, bundle.targets, bundle.loss_fn, repeats, clock=clock, precision=precision
        )
        non_tensor_edges = [list(edge) for edge in profiler.non_tensor_edges]
        if non_tensor_edges:
            log.warning("layers read non-tensor values from other layers: %s", non_tensor_edges[:5])
        del profiler
        after = measure_step(
            *step_args, repeats=max(1, repeats - 1), warmup=0, budget_ms=math.inf, clock=clock,
            precision=precision,
        )  # fmt: skip
        samples = before.samples_ms + after.samples_ms
        step = StepCost(statistics.median(samples), samples)
        update = measure_update(gm, repeats, clock)
        fixed, fixed_note = (
            measure_fixed(gm, traced.groups, bundle.inputs, batch_size, costs, repeats, clock, precision)
            if fixed_cost
            else ({}, {"skipped": "profiled with --no-fixed-cost"})
        )
    except PipeplanError:
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise TraceError(
            f"running the traced {spec} failed: {type(exc).__name__}: {first}; "
            "mark the module that fails with --leaf-module CLASS"
        ) from exc
    nodes = _nodes(traced, costs, loss_ms, bundle.loss_fn, fixed)
    return Profile(
        nodes=nodes,
        model=spec,
        batch_size=batch_size,
        inputs=tuple(TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in bundle.inputs),
        device=str(where),
        dtype=str(param_dtype).removeprefix("torch."),
        precision=precision,
        torch_version=torch.__version__,
        tracer=traced.tracer,
        tracer_options=dict(traced.options),
        step_ms=step.step_ms,
        tied=_tied(bundle.module),
        extra={
            "threads": torch.get_num_threads(),
            "repeats": repeats,
            "step_of": "graph_module",
            "clock": clock,
            "step_samples_ms": list(step.samples_ms),
            "loss_ms": list(loss_ms),
            "profile_wall_s": round(time.perf_counter() - started, 3),
            "non_tensor_edges": non_tensor_edges,
            "loadavg_1min": [load_before, _load()],
            "cpus": os.cpu_count(),
            UPDATE_KEY: update,
            "fixed_cost": fixed_note,
        },
    )


def _load() -> float:
    """The 1-minute load average: how busy the machine was (other jobs inflate wall-clock times)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return 0.0


def _placed(bundle: ModelBundle, device: torch.device, dtype: torch.dtype) -> ModelBundle:
    def move(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    bundle.module.to(device=device, dtype=dtype)
    return replace(bundle, inputs=tuple(move(t) for t in bundle.inputs), targets=move(bundle.targets))


def _tied(module: nn.Module) -> tuple[tuple[str, ...], ...]:
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def _nodes(
    traced: Traced,
    costs: dict[str, LayerCost],
    loss_ms: tuple[float, float],
    loss_fn: Callable[..., Any],
    fixed: dict[str, tuple[float, float]],
) -> tuple[Node, ...]:
    gm = traced.graph_module
    owner = {m: g.id for g in traced.groups for m in g.members}
    counted: set[int] = set()
    nodes = []
    for group in traced.groups:
        members = [n for n in gm.graph.nodes if n.name in set(group.members)]
        names, params = _group_params(gm, members)
        fresh = [p for p in params if id(p) not in counted]
        counted.update(id(p) for p in fresh)
        sources = [
            a for m in members for a in m.all_input_nodes if a.op != "get_attr" and owner[a.name] != group.id
        ]
        cost = costs[group.id]
        fwd, bwd = (cost.forward_ms, cost.backward_ms) if group.op != "output" else loss_ms
        description = group.description or (
            f"loss: {getattr(loss_fn, '__name__', 'loss_fn')}" if group.op == "output" else ""
        )
        nodes.append(
            Node(
                id=group.id,
                name=group.name,
                op=group.op,
                target=group.target,
                inputs=tuple(dict.fromkeys(owner[a.name] for a in sources)),
                forward_ms=fwd,
                backward_ms=bwd,
                output_bytes=cost.output_bytes,
                saved_bytes=cost.saved_bytes,
                cast_bytes=cost.cast_bytes,
                param_bytes=sum(p.numel() * p.element_size() for p in fresh),
                param_names=tuple(names),
                description=description,
                members=group.members if len(group.members) > 1 else (),
                forward_fixed_ms=fixed.get(group.id, (0.0, 0.0))[0] if group.op != "output" else 0.0,
                backward_fixed_ms=fixed.get(group.id, (0.0, 0.0))[1] if group.op != "output" else 0.0,
            )
        )
    return tuple(nodes)


def _group_params(gm: fx.GraphModule, members: list[fx.Node]) -> tuple[list[str], list[Tensor]]:
    """Qualified names of the parameters a layer uses (tied ones under its own name) and the tensors."""
    names: dict[str, Tensor] = {}
    for m in members:
        if m.op == "call_module":
            sub = gm.get_submodule(str(m.target))
            names.update(sub.named_parameters(prefix=str(m.target), remove_duplicate=False))
        for a in [m, *m.all_input_nodes]:
            if (
                a.op == "get_attr"
                and a.users
                and isinstance(p := getattr_path(gm, str(a.target)), nn.Parameter)
            ):
                names[str(a.target)] = p
    unique = list({id(p): p for p in names.values()}.values())
    return list(names), unique


__all__ += ["Group", "Traced"]
