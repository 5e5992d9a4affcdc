"""The profiler: model spec -> traced layers -> measured ``Profile``.

Example:
    >>> profile = profile_model("tiny-mlp", batch_size=4, repeats=1)
    >>> [n.id for n in profile.nodes][:3]
    ['x', 'fc1', 'act1']
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, fx, nn

from partitioner.errors import PipeplanError, TraceError
from partitioner.graph import SPLIT_CALL, Node, Profile, TensorSpec, scale_batch
from partitioner.hardware.devices import device_model_to_json, load_device_model
from partitioner.models.specs import ModelBundle, load_model
from partitioner.optimizer.pricing.price import gib
from partitioner.profiler import tensor_check, tensor_plan
from partitioner.profiler.budget import choose_materialize
from partitioner.profiler.cpu_model import cpu_model
from partitioner.profiler.estimate import (
    LayerEstimator,
    estimate_loss,
    estimate_update,
    moe_assumption,
    on_meta,
)
from partitioner.profiler.fake import trace_weightless
from partitioner.profiler.fixed import estimate_sizes, measure_fixed, sizes_of, small_batch
from partitioner.profiler.layerwise import LayerwiseProfiler, Weights
from partitioner.profiler.measure import (
    LayerCost,
    LayerProfiler,
    StepCost,
    getattr_path,
    measure_loss,
    measure_loss_memory,
    measure_step,
)
from partitioner.profiler.split_call import split_call_ms
from partitioner.profiler.tensor_fields import with_tensor_fields
from partitioner.profiler.trace import Group, Traced, trace_model
from partitioner.profiler.update_cost import UPDATE_KEY
from partitioner.profiler.update_timing import measure_update
from partitioner.sized import SizedCost
from runtime.precision import PRECISIONS

__all__ = [
    "ESTIMATE_KEY",
    "MEASURED_KEY",
    "check_precision_options",
    "check_weights_fit",
    "profile_model",
    "resolve_device",
    "resolve_dtype",
]

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]

ESTIMATE_KEY = "estimate"
"""``profile.extra`` key of an estimated profile: the device model (with its sources) and what the
estimate assumed. Absent from measured profiles."""

MEASURED_KEY = "layers_measured"
"""``profile.extra`` key: how many layers the profile has, how many distinct ones were measured (or
estimated), and which layer shares which one's measurement."""


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
    materialize: str = "auto",
    reuse: bool = True,
    device_model: str | None = None,
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
        materialize: ``whole`` (the model real on the device: every layer measured on one real
            forward, and the whole step timed), ``layer`` (built without its weights, each layer real
            only while measured: peak memory one layer; no step time) or ``auto`` (whole while the
            weights take at most an eighth of the free memory; :mod:`partitioner.profiler.budget`).
        reuse: measure identical layers once (:mod:`partitioner.profiler.fingerprint`).
        device_model: estimate every layer for this device instead of measuring it: a preset
            (``h100``, ``a100-80gb``, ``h200``; ``cpu``: this machine's measured rates) or a device
            model JSON file (:mod:`partitioner.hardware.devices`). Nothing is materialised; ``device``,
            ``repeats``, ``clock``, ``fixed_cost`` and ``materialize`` do not apply.

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
    if device_model is not None:
        if (clock != "wall" and device_model != "cpu") or materialize not in ("auto", "layer"):
            raise PipeplanError(
                "--device-model estimates times without running the model: --clock (but for the cpu "
                "model) and --materialize whole do not apply"
            )
        profile = _estimated(
            spec, measured, input_shape, dtype, leaf_modules, progress, precision, reuse, device_model,
            threads, clock,
        )  # fmt: skip
        return scale_batch(profile, batch_size) if measured != batch_size else profile
    previous = torch.get_num_threads()
    if threads is None and resolve_device(device).type == "cpu":
        threads = 1  # a CPU rank of `pipeplan run` gets cores / ranks threads: one as soon as ranks >= cores
    torch.set_num_threads(threads or previous)
    try:
        profile = _profile(
            spec, measured, input_shape, device, dtype, leaf_modules, repeats, progress, clock, precision,
            fixed_cost, materialize, reuse,
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
    materialize: str = "whole",
    reuse: bool = True,
) -> Profile:
    """profile_model's work, under the thread count it set."""
    started, load_before = time.perf_counter(), _load()
    where, param_dtype = resolve_device(device), resolve_dtype(dtype)
    if clock == "cpu" and where.type != "cpu":
        raise PipeplanError("--clock cpu measures CPU time: it only applies to --device cpu")
    lazy = None
    if materialize != "whole":
        fixed = fixed_cost and small_batch(batch_size) is not None
        lazy, materialize = _lazy_or_whole(
            spec, batch_size, input_shape, where, param_dtype, materialize, fixed
        )
    options = _Options(repeats, progress, clock, precision, fixed_cost, reuse)
    with _failures(f"running the traced {spec}", "mark the module that fails with --leaf-module CLASS"):
        if lazy is not None and materialize == "layer":
            bundle, traced = lazy, trace_weightless(lazy, where, leaf_modules, input_shape)
            run = _by_layer(bundle, traced, where, options)
        else:
            bundle = _placed(load_model(spec, batch_size, input_shape), where, param_dtype)
            traced = trace_model(bundle, leaf_modules, input_shape)
            run = _whole(bundle, traced, batch_size, options)
    extra = {
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "clock": clock,
        "materialized": materialize,
        **run.extra,
        "profile_wall_s": round(time.perf_counter() - started, 3),
        "loadavg_1min": [load_before, _load()],
        "cpus": os.cpu_count(),
    }
    return _assemble(spec, bundle, traced, where, param_dtype, precision, run, extra)


def _estimated(
    spec: str,
    batch_size: int,
    input_shape: tuple[int, ...] | None,
    dtype: str,
    leaf_modules: Sequence[str],
    progress: Progress | None,
    precision: str,
    reuse: bool,
    device_model: str,
    threads: int | None,
    clock: str = "wall",
) -> Profile:
    """The profile ``device_model`` would give: every layer estimated on the meta device
    (:mod:`partitioner.profiler.estimate`), traced as on a CPU (what ``partition`` re-traces)."""
    started, load_before = time.perf_counter(), _load()
    model = cpu_model(threads or 1, clock=clock) if device_model == "cpu" else load_device_model(device_model)
    param_dtype, cpu = resolve_dtype(dtype), torch.device("cpu")
    bundle = _lazy_bundle(load_model(spec, batch_size, input_shape, lazy=True), cpu, param_dtype)
    traced = trace_weightless(bundle, cpu, leaf_modules, input_shape)
    meta = on_meta(traced.graph_module)
    estimator = LayerEstimator(meta, traced.groups, model, precision, reuse, progress)
    with _failures(
        f"estimating {spec} on the meta device", "keep the module that fails whole with --leaf-module"
    ):
        costs = estimator.profile(*(t.to("meta") for t in bundle.inputs))
        loss_ms = estimate_loss(estimator.result, bundle.targets, bundle.loss_fn, model, precision)
        _record_loss_memory(costs, estimator.groups, estimator.result, bundle, precision)
        sized = estimate_sizes(
            lambda: LayerEstimator(meta, traced.groups, model, precision, reuse),
            [t.to("meta") for t in bundle.inputs], batch_size, costs,
        )  # fmt: skip
    assumptions = [*model.assumptions]
    moe = moe_assumption(bundle.module)
    if moe:
        assumptions.append(moe)
    if precision != "fp32":
        assumptions.append(
            f"{precision} autocast: CUDA autocast's casting rules applied on the meta device (matrix "
            f"products, convolutions and attention in {precision}, softmax, norms and losses in float32; "
            "partitioner/profiler/meta_autocast.py), so activations and saved bytes have the dtypes a "
            "run under autocast gives them"
        )
    estimate = {
        "device_model": device_model_to_json(model),
        "from": device_model,
        "assumptions": assumptions,
    }
    sizes = [batch_size, *sizes_of(batch_size)]
    extra = {
        ESTIMATE_KEY: estimate,
        "loss_ms": list(loss_ms),
        **_profiler_notes(estimator),
        UPDATE_KEY: estimate_update(traced.graph_module, model),
        "fixed_cost": {"estimated": "one kernel launch per kernel", "sizes": sizes},
        "materialized": "none",
        "profile_wall_s": round(time.perf_counter() - started, 3),
        "loadavg_1min": [load_before, _load()],
        "cpus": os.cpu_count(),
    }
    run = _Run(costs, loss_ms, None, estimator.fixed(), extra, sized)
    where = "cpu" if device_model == "cpu" else model.name
    profile = _assemble(spec, bundle, traced, where, param_dtype, precision, run, extra)
    profile = with_tensor_fields(profile, bundle.module)  # (docs/layout-3d.md: the 3D planner's fields)
    check_weights_fit(profile, model.memory_bytes, model.name)
    return profile


@contextlib.contextmanager
def _failures(doing: str, hint: str) -> Iterator[None]:
    """A model's own exception while it is traced, run or estimated as one TraceError line."""
    try:
        yield
    except PipeplanError:
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise TraceError(f"{doing} failed: {type(exc).__name__}: {first}; {hint}") from exc


def check_weights_fit(profile: Profile, memory_bytes: int, device: str) -> None:
    """A PipeplanError naming the largest layer whose weights alone exceed a device's memory: a
    pipeline cuts between layers, so no plan can hold it (``partition`` checks the weights with
    their gradients and optimizer state against its ``--memory``)."""
    worst = max(profile.layers, key=lambda n: n.param_bytes, default=None)
    if worst is not None and worst.param_bytes > memory_bytes:
        raise PipeplanError(
            f"layer {worst.name} has {gib(worst.param_bytes)} of weights and a {device} has "
            f"{gib(memory_bytes)}: no device can hold it (a pipeline splits a model between layers, "
            "not inside one); use a device with more memory or lower-precision weights (--dtype)"
        )


@dataclass(frozen=True)
class _Options:
    """How to measure: profile_model's arguments, passed on together."""

    repeats: int
    progress: Progress | None
    clock: str
    precision: str
    fixed_cost: bool
    reuse: bool


@dataclass(frozen=True)
class _Run:
    """What one way of profiling measured: per-group costs, the loss, the whole step if measured,
    each layer's fixed time per call, and what to record in ``profile.extra``."""

    costs: Mapping[str, LayerCost]
    loss_ms: tuple[float, float]
    step_ms: float | None
    fixed: Mapping[str, tuple[float, float]]
    extra: Mapping[str, Any]
    sized: Mapping[str, tuple[SizedCost, ...]] = field(default_factory=dict)
    """per group, its times at each measured microbatch size (``Node.sized``)."""


def _whole(bundle: ModelBundle, traced: Traced, batch_size: int, o: _Options) -> _Run:
    """The model real and whole on the device: every layer measured on the values of one forward,
    bracketed by timings of the whole step (the yardstick of ``Profile.fidelity``)."""
    gm = traced.graph_module
    # The step runs the traced graph, the code the pipeline stages are cut from (for fx, the model's own
    # modules; for export, its aten ops without the Python around them). Its samples bracket the layer
    # measurements, so both see the same machine load.
    inputs = dict(zip(bundle.input_names, bundle.inputs, strict=True)) if bundle.input_names else None
    step_args = (gm, inputs or bundle.inputs, bundle.targets, bundle.loss_fn)
    before = measure_step(*step_args, repeats=1, warmup=1, clock=o.clock, precision=o.precision)
    profiler = LayerProfiler(
        gm, traced.groups, repeats=o.repeats, progress=o.progress, clock=o.clock, precision=o.precision,
        reuse=o.reuse, split=o.fixed_cost,
    )  # fmt: skip
    costs, loss_ms, notes = _layers_and_loss(profiler, bundle, o)
    del profiler
    after = measure_step(
        *step_args, repeats=max(1, o.repeats - 1), warmup=0, budget_ms=math.inf, clock=o.clock,
        precision=o.precision,
    )  # fmt: skip
    samples = before.samples_ms + after.samples_ms
    step = StepCost(statistics.median(samples), samples)
    update = measure_update(gm, o.repeats, o.clock)
    fixed, sized, fixed_note = (
        measure_fixed(gm, traced.groups, bundle.inputs, batch_size, costs, o.repeats, o.clock, o.precision)
        if o.fixed_cost
        else ({}, {}, {"skipped": "profiled with --no-fixed-cost"})
    )
    split_call = {SPLIT_CALL: split_call_ms(_device_of(gm), o.clock)} if o.fixed_cost else {}
    extra = {
        "step_of": "graph_module",
        "step_samples_ms": list(step.samples_ms),
        "loss_ms": list(loss_ms),
        **notes,
        UPDATE_KEY: update,
        "fixed_cost": fixed_note,
        **split_call,
    }
    return _Run(costs, loss_ms, step.step_ms, fixed, extra, sized)


def _device_of(gm: torch.nn.Module) -> torch.device:
    """Where the traced graph's weights are (the CPU for a model without any)."""
    first = next(iter(gm.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _by_layer(bundle: ModelBundle, traced: Traced, where: torch.device, o: _Options) -> _Run:
    """The model on the meta device, each layer made real on ``where`` only while it is measured
    (:mod:`partitioner.profiler.layerwise`): no whole step, so no fidelity."""
    gm = traced.graph_module
    profiler = LayerwiseProfiler(
        gm, traced.groups, Weights(gm, bundle.buffers, where), repeats=o.repeats, progress=o.progress,
        clock=o.clock, precision=o.precision, reuse=o.reuse,
    )  # fmt: skip
    costs, loss_ms, notes = _layers_and_loss(profiler, bundle, o)
    del profiler
    update = measure_update(gm, o.repeats, o.clock, device=where)
    skipped = "measured layer by layer on a graph of static shapes, which runs one batch size only"
    extra = {
        "loss_ms": list(loss_ms),
        **notes,
        UPDATE_KEY: update,
        "fixed_cost": {"skipped": skipped if o.fixed_cost else "profiled with --no-fixed-cost"},
    }
    return _Run(costs, loss_ms, None, {}, extra)


def _layers_and_loss(
    profiler: LayerProfiler, bundle: ModelBundle, o: _Options
) -> tuple[dict[str, LayerCost], tuple[float, float], dict[str, Any]]:
    """Every layer's cost, the loss's (forward, backward) on the layers' output, and the notes."""
    costs = profiler.profile(*bundle.inputs)
    loss_ms = measure_loss(
        profiler.result, bundle.targets, bundle.loss_fn, o.repeats, clock=o.clock, precision=o.precision
    )
    _record_loss_memory(costs, profiler.groups, profiler.result, bundle, o.precision)
    return costs, loss_ms, _profiler_notes(profiler)


def _record_loss_memory(
    costs: dict[str, LayerCost], groups: Sequence[Group], output: Any, bundle: ModelBundle, precision: str
) -> None:
    """The loss's saved and working bytes (:func:`measure_loss_memory`) on the output node, the one
    the last stage runs the loss on."""
    saved, working = measure_loss_memory(output, bundle.targets, bundle.loss_fn, precision)
    for group in groups:
        if group.op == "output":
            costs[group.id] = replace(costs[group.id], saved_bytes=saved, working_bytes=working)


def _profiler_notes(profiler: LayerProfiler) -> dict[str, Any]:
    """What a profiler run records beside the costs: non-tensor edges and which layers were measured."""
    non_tensor_edges = [list(edge) for edge in profiler.non_tensor_edges]
    if non_tensor_edges:  # (nothing for a user to do: an info line, not a warning)
        log.info(
            "%d layers read a size or other non-tensor value another layer computes; a stage cut between "
            "them recomputes it from the tensors it receives (first: %s)",
            len(non_tensor_edges), non_tensor_edges[:3],
        )  # fmt: skip
    layers = [g for g in profiler.groups if g.op not in ("input", "output")]
    measured = {
        "layers": len(layers),
        "distinct": len(layers) - len(profiler.twins),
        "reused": dict(profiler.twins),
    }
    return {"non_tensor_edges": non_tensor_edges, MEASURED_KEY: measured}


def _assemble(
    spec: str,
    bundle: ModelBundle,
    traced: Traced,
    where: torch.device | str,
    param_dtype: torch.dtype,
    precision: str,
    run: _Run,
    extra: Mapping[str, Any],
) -> Profile:
    """The profile of a traced model from what a run measured (or estimated)."""
    nodes = _nodes(traced, run.costs, run.loss_ms, bundle.loss_fn, run.fixed, run.sized)
    layers, whole = tensor_check.derive_checked(traced.graph_module, bundle.module, bundle.inputs)
    nodes = tensor_plan.profiled(nodes, traced.graph_module, bundle.module, bundle.inputs, precision, layers)
    extra = {**extra, tensor_check.WHOLE_KEY: whole} if whole else extra
    unknown = tensor_plan.unknown_styles(bundle.module)
    extra = {**extra, tensor_plan.UNKNOWN_KEY: unknown} if unknown else extra
    return Profile(
        nodes=nodes,
        model=spec,
        batch_size=bundle.batch_size,
        inputs=tuple(TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in bundle.inputs),
        device=str(where),
        dtype=str(param_dtype).removeprefix("torch."),
        precision=precision,
        torch_version=torch.__version__,
        tracer=traced.tracer,
        tracer_options=dict(traced.options),
        step_ms=run.step_ms,
        tied=_tied(bundle.module),
        extra=dict(extra),
    )


def _load() -> float:
    """The 1-minute load average: how busy the machine was (other jobs inflate wall-clock times)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return 0.0


def _lazy_or_whole(
    spec: str,
    batch_size: int,
    input_shape: tuple[int, ...] | None,
    where: torch.device,
    dtype: torch.dtype,
    materialize: str,
    fixed_cost: bool,
) -> tuple[ModelBundle | None, str]:
    """The model built without its weights and ``whole`` or ``layer`` (``auto`` decided from its
    size and its repeated blocks, :func:`choose_materialize`); under ``auto``, a model that cannot
    be built so (its file runs it on the meta device, and it reads a value) is profiled whole."""
    try:
        lazy = _lazy_bundle(load_model(spec, batch_size, input_shape, lazy=True), where, dtype)
    except PipeplanError as exc:
        if materialize == "layer":
            raise PipeplanError(
                f"{exc}; building {spec} without its weights failed: try --materialize whole"
            ) from exc
        log.info("cannot build %s without its weights (%s): profiling it whole", spec, exc)
        return None, "whole"
    return lazy, choose_materialize(materialize, lazy.module, where, fixed_cost)


def _lazy_bundle(bundle: ModelBundle, device: torch.device, dtype: torch.dtype) -> ModelBundle:
    """A bundle built without its weights, in ``dtype`` (weights, float buffers and float inputs) and
    with its inputs on ``device``; the module stays on the meta device."""

    def move(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    bundle.module.to(dtype=dtype)
    buffers = {k: v.to(dtype) if v.is_floating_point() else v for k, v in bundle.buffers.items()}
    return replace(
        bundle, inputs=tuple(move(t) for t in bundle.inputs), targets=move(bundle.targets), buffers=buffers
    )


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
    costs: Mapping[str, LayerCost],
    loss_ms: tuple[float, float],
    loss_fn: Callable[..., Any],
    fixed: Mapping[str, tuple[float, float]],
    sized: Mapping[str, tuple[SizedCost, ...]],
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
                working_bytes=cost.working_bytes,
                deferred_bytes=cost.deferred_bytes,
                kept_output_bytes=cost.kept_output_bytes,
                param_bytes=sum(p.numel() * p.element_size() for p in fresh),
                largest_tensor_bytes=max((p.numel() * p.element_size() for p in fresh), default=0),
                param_names=tuple(names),
                description=description,
                members=group.members if len(group.members) > 1 else (),
                forward_fixed_ms=fixed.get(group.id, (0.0, 0.0))[0] if group.op != "output" else 0.0,
                backward_fixed_ms=fixed.get(group.id, (0.0, 0.0))[1] if group.op != "output" else 0.0,
                sized=sized.get(group.id, ()) if group.op not in ("input", "output") else (),
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
