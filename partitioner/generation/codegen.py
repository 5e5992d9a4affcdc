"""(traced graph, plan) -> the ``gpus=N`` package: ``__init__.py``, ``stageK.py``, mp_conf.json, plan.json.

Each stage's ``forward`` is torch.fx's own code generation for that stage's cut of the traced graph
(:mod:`partitioner.generation.split`); only the scaffolding around it (imports, the class line, the name
tables) is written here. Stage modules hold the original submodules under their original paths, so
``features.3.weight`` is called the same in a stage, in the full model and in a checkpoint.

Parameters are built by ``_stagekit.py`` (a verbatim copy of :mod:`runtime.building.stage_init`): seeded per
module by default, or memory-mapped from ``--weights model.pt``; see that module's docstring.

Example:
    >>> plan = write_package(profile, plan, Path("models/vgg16/gpus=4"))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from partitioner.errors import PackageError, PipeplanError, PlanError
from partitioner.generation.package_text import init_text, source_text, stage_text
from partitioner.generation.split import CONSTANT_MAX_ELEMENTS, StageGraph, kinds_and_output, split_graph
from partitioner.graph import Profile
from partitioner.plan import Plan, Tie, mp_conf, plan_to_json
from partitioner.profiler import tensor_check, tensor_plan
from runtime.building import stage_init as stagekit
from runtime.files.user_code import UserFileError
from runtime.job.run_lock import holder
from runtime.schedule import SCHEDULES, get_schedule

__all__ = [
    "EXACT_INIT_MAX_BYTES",
    "assignment_of",
    "lifted_constants",
    "pipedream_names",
    "ties_of",
    "with_ranks",
    "write_package",
    "write_package_from_trace",
    "write_plan_files",
]

log = logging.getLogger(__name__)

EXACT_INIT_MAX_BYTES = 2 * 2**30  # larger models initialise per module: no rank draws all of their weights


def write_package(
    profile: Profile, plan: Plan, out_dir: Path, weights: Path | None = None, init: str = "auto"
) -> Plan:
    """Re-trace the profiled model and write its stage package into ``out_dir`` (replaced atomically).

    For a PipeDream graph.txt profile there is no model to trace: only plan.json and mp_conf.json.

    Args:
        profile: the profile the plan was made from (model spec and tracer options).
        plan: the stages; their nodes are profile node ids.
        out_dir: the package folder (``models/<model>/gpus=N``).
        weights: a ``torch.save(model.state_dict())`` file, a ``.safetensors`` file or a
            ``save_pretrained`` folder the stages read their tensors from (each only its own).
        init: ``exact`` (stages start as ``torch.manual_seed(seed); factory()`` would; each rank
            runs the factory's random draws once, holding only its stage), ``seeded`` (per-module
            seeds; a rank draws only its stage) or ``auto`` (exact up to 2 GiB of parameters,
            else seeded).

    Raises:
        PackageError: the weights file lacks tensors, or the loss cannot be expressed by the package.
        PlanError: the plan names nodes the trace does not have, or runs a node before its inputs.
    """
    plan = with_ranks(plan)
    if profile.tracer == "pipedream":
        write_plan_files(plan, Path(out_dir))
        return plan
    options = dict(profile.tracer_options) or {"spec": profile.model, "batch_size": profile.batch_size or 1}
    bundle, traced = _retrace(profile, options, _trace_batch(options, plan))
    if traced.tracer != profile.tracer:
        raise PackageError(
            f"re-tracing {bundle.spec} used {traced.tracer}, the profile used {profile.tracer}"
        )
    return write_package_from_trace(
        profile, plan, Path(out_dir), traced.graph_module, bundle, traced.tracer, weights, init
    )


def _retrace(profile: Profile, options: Mapping[str, Any], batch: int) -> tuple[Any, Any]:
    """(bundle, traced graph) of the profiled model, built without its weights where it can be.

    fx traces structure and shapes only: its model is built on meta. torch.export's graph is traced
    on fake CPU tensors of a model whose parameters were never allocated
    (:func:`partitioner.profiler.fake.trace_weightless`: the graph a real model gives, node names
    included), so writing the package of a model larger than this machine costs its buffers only. A
    model whose graph depends on its tensors' values cannot be traced on fake tensors: it is built
    whole in float32 and traced for real, as before, when that fits in half the free memory.
    """
    from partitioner.models.specs import load_model
    from partitioner.profiler.budget import too_big_to_build
    from partitioner.profiler.fake import trace_weightless
    from partitioner.profiler.trace import trace_model

    spec = str(options["spec"])
    shape = tuple(options["input_shape"]) if options.get("input_shape") else None
    leaves = tuple(options.get("leaf_modules", ()))
    dynamic = not options.get("static_shapes")  # a graph traced with static shapes is traced so again
    if profile.tracer == "fx":
        bundle = load_model(spec, batch, shape, device="meta")
        return bundle, trace_model(bundle, leaves, shape, dynamic=dynamic)
    try:
        bundle = load_model(spec, batch, shape, lazy=True)
        return bundle, trace_weightless(bundle, torch.device("cpu"), leaves, shape, dynamic=dynamic)
    except Exception as exc:
        too_big = too_big_to_build(profile)
        if too_big:
            raise PackageError(
                f"{spec} cannot be traced without its weights ({type(exc).__name__}: {exc}), and "
                f"{too_big}; write the package on a machine with more memory"
            ) from exc
        log.info("tracing %s without its weights failed (%s); building it whole", spec, exc)
    bundle = load_model(spec, batch, shape)
    return bundle, trace_model(bundle, leaves, shape, dynamic=dynamic)


def _trace_batch(options: Mapping[str, Any], plan: Plan) -> int:
    """The batch size to trace at: the profile's, or, for static-shape graphs, the size one forward runs.

    A graph exported with static shapes has the batch size baked into its views, so it is re-traced at
    the microbatch size the runtime will feed each stage (same node names, other constants).
    """
    traced = int(options.get("batch_size") or 1)
    if not options.get("static_shapes") or not plan.batch_size:
        return traced
    return max(1, plan.batch_size // max(1, plan.microbatches))


def write_plan_files(plan: Plan, out_dir: Path) -> None:
    """plan.json and mp_conf.json only (graph.txt profiles, which have no model code)."""
    files = {"plan.json": _json(plan_to_json(plan)), "mp_conf.json": _json(mp_conf(plan.stages))}
    _write_folder(out_dir, files, keep_existing=True)


def write_package_from_trace(
    profile: Profile,
    plan: Plan,
    out_dir: Path,
    gm: fx.GraphModule,
    bundle: Any,
    tracer: str,
    weights: Path | None = None,
    init: str = "auto",
) -> Plan:
    """The package for an already traced graph; ``bundle`` is the profiler's ModelBundle."""
    if init not in ("auto", "exact", "seeded"):
        raise PackageError(f"init must be auto, exact or seeded, got {init!r}")
    if init == "auto":
        size = sum(p.numel() * p.element_size() for p in bundle.module.parameters())
        init = "exact" if size <= EXACT_INIT_MAX_BYTES else "seeded"
    inputs = tuple(bundle.inputs)
    reshaped = bool(dict(profile.tracer_options).get("input_shape"))
    kinds, _, output = kinds_and_output(gm, inputs)  # one run of the graph, without computing
    drop = _foreign_calls(gm, bundle.module)
    stages = split_graph(
        gm,
        assignment_of(profile, plan),
        len(plan.stages),
        kinds,
        tracer == "export",
        drop,
        lifted_constants(gm, bundle.module),
    )
    _check_tensors(stages, bundle.module)
    weights_path = str(Path(weights).resolve()) if weights else None
    if weights_path:
        _check_weights(weights_path, bundle.module)
    loss = _loss_kind(bundle, gm, inputs)
    names = pipedream_names([n.name for n in gm.graph.nodes if n.op == "placeholder"], stages)
    extra = _extra(gm, bundle, stages, names, loss, weights_path, tracer, init, reshaped, output)
    final = replace(
        plan,
        model=plan.model or profile.model,
        ties=ties_of(bundle.module, stages),
        extra={**dict(plan.extra), **extra},
    )
    zoo = _zoo_model(str(bundle.spec))
    source = source_text(profile, final, bundle, loss, weights_path, init, zoo[0] if zoo else None)
    package = init_text(profile, final, stages, init, weights_path, names)
    files = {"__init__.py": package, "_source.py": source}
    files["_stagekit.py"] = Path(stagekit.__file__).read_text(encoding="utf-8")
    if zoo:
        files["_model.py"] = zoo[1]
    files.update({f"stage{s.index}.py": stage_text(profile, final, s, len(stages)) for s in stages})
    files["plan.json"] = _json(plan_to_json(final))
    files["mp_conf.json"] = _json(mp_conf(final.stages))
    if any(s.tensor_parallel > 1 for s in final.stages):  # what the runtime splits (docs/layout-3d.md)
        layers, _ = tensor_check.derive_checked(gm, bundle.module, inputs)  # (as the profile priced)
        files["tensor_plan.json"] = _json(tensor_plan.to_json(layers))
    _write_folder(Path(out_dir), files)
    return final


# ---------------------------------------------------------------- plan -> graph


def with_ranks(plan: Plan) -> Plan:
    """The plan with every stage's ranks checked, or assigned contiguously when none are given.

    Raises:
        PlanError: a stage with as many ranks as replicas is missing, or a rank used twice or skipped.
    """
    if all(not s.ranks for s in plan.stages):
        stages, first = [], 0
        for s in plan.stages:
            stages.append(replace(s, ranks=tuple(range(first, first + s.devices))))
            first += s.devices
        return replace(plan, stages=tuple(stages))
    for s in plan.stages:
        if len(s.ranks) != s.devices:
            raise PlanError(f"stage {s.index} has {s.devices} devices but ranks {list(s.ranks)}")
    ranks = sorted(r for s in plan.stages for r in s.ranks)
    placement = get_schedule(plan.schedule).placement if plan.schedule in SCHEDULES else None
    laid_out = plan.virtual_stages > 1 and placement is not None  # several stages per rank
    if placement is not None and laid_out and all(s.devices == 1 for s in plan.stages):
        want = placement(plan.gpus, plan.virtual_stages)
        if tuple(s.ranks for s in plan.stages) != want:
            raise PlanError(f"{plan.schedule} stages must lie on ranks {[r for (r,) in want]}, got {ranks}")
    # (laid out on copies or tensor ranks, ranks repeat: the runtime checks each copy's pipeline)
    elif sorted(set(ranks) if laid_out else ranks) != list(range(len(set(ranks) if laid_out else ranks))):
        raise PlanError(f"stage ranks must use 0..{len(ranks) - 1} once each, got {ranks}")
    return plan


def assignment_of(profile: Profile, plan: Plan) -> dict[str, int]:
    """Traced node name -> stage index, through each profile node's ``members``."""
    known = {node.id: node for node in profile.nodes}
    assignment: dict[str, int] = {}
    for stage in plan.stages:
        for node_id in stage.nodes:
            node = known.get(node_id)
            if node is None:
                raise PlanError(f"the plan names node {node_id!r}, which the profile does not have")
            if node.op in ("input", "output"):
                continue
            for member in node.members or (node.id,):
                assignment[member] = stage.index
    return assignment


def pipedream_names(inputs: Sequence[str], stages: Sequence[StageGraph]) -> dict[str, str]:
    """Each tensor at a stage boundary -> its name in PipeDream's packages: the model's inputs are
    ``input0``, ``input1``.. in argument order, tensors first returned by a stage ``out0``, ``out1``..
    in stage and return order, so PipeDream's own tools (its shape-inference loop) read our packages.

    Raises:
        PackageError: a stage reads a tensor that is neither a model input nor an earlier stage's output.
    """
    names = {name: f"input{i}" for i, name in enumerate(inputs)}
    for stage in stages:
        unknown = [n for n in stage.in_names if n not in names]
        if unknown:
            raise PackageError(f"internal: stage {stage.index} reads {unknown[0]!r}, which nothing produces")
        for name in stage.out_names:
            names.setdefault(name, f"out{sum(v.startswith('out') for v in names.values())}")
    return names


def _zoo_model(spec: str) -> tuple[str, str] | None:
    """A built-in model's factory name and the text of its source file, or None for other specs.

    The file is copied into the package as ``_model.py``: a package needs torch and ``runtime`` only,
    never ``partitioner`` (whose zoo a cluster node does not have). Zoo files import torch alone.
    """
    from partitioner.models.zoo import ZOO

    entry = ZOO.get(spec)
    if entry is None:
        return None
    source = sys.modules[entry.factory.__module__].__file__
    assert source is not None
    return entry.factory.__name__, Path(source).read_text(encoding="utf-8")


def _foreign_calls(gm: fx.GraphModule, model: nn.Module) -> frozenset[str]:
    """Unused calls of modules the model does not have (torch.export's ``_guards_fn``): left out."""
    known = {name for name, _ in model.named_modules()}
    foreign = [n for n in gm.graph.nodes if n.op == "call_module" and n.target not in known]
    used = [n.name for n in foreign if n.users]
    if used:
        raise PackageError(f"the traced graph calls {used[0]}, which is not a module of the model")
    return frozenset(n.name for n in foreign)


def lifted_constants(gm: fx.GraphModule, model: nn.Module) -> dict[str, torch.Tensor]:
    """Tensors the graph reads that the model does not have at all: torch.export lifts a
    ``torch.tensor(...)`` or a Python list used as an index inside ``forward`` into such attributes.
    Each stage that reads one writes it into its own code
    (:func:`partitioner.generation.split.constant_node`). A plain tensor attribute of the model (set in
    ``__init__``, perhaps from the RNG) is no constant: ``_check_tensors`` asks for a buffer.

    Raises:
        PackageError: a constant too large to write into code (make it a buffer in ``__init__``).
    """
    state = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    state |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    found: dict[str, torch.Tensor] = {}
    for node in gm.graph.nodes:
        target = str(node.target)
        if node.op != "get_attr" or target in state or _attribute(model, target) is not None:
            continue
        value = _attribute(gm, target)
        if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
            continue
        if value.numel() > CONSTANT_MAX_ELEMENTS:
            raise PackageError(
                f"the model makes a constant tensor of {value.numel()} elements in forward ({target}); "
                f"stages write constants of up to {CONSTANT_MAX_ELEMENTS} into their code: create it once "
                "in __init__ with register_buffer(..., persistent=False)"
            )
        found[target] = value
    return found


def _attribute(root: nn.Module, path: str) -> Any:
    value: Any = root
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def _check_tensors(stages: Sequence[StageGraph], model: nn.Module) -> None:
    """Every tensor a stage reads directly must be a parameter or buffer, which stages can rebuild."""
    state = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    state |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    for stage in stages:
        unknown = [t for t in stage.tensors if t not in state]
        if unknown:
            raise PackageError(
                f"stage {stage.index} reads {unknown[0]!r}, a tensor that is no parameter or buffer "
                "of the model; register it with register_buffer() so stages can rebuild it"
            )


def ties_of(model: nn.Module, stages: Sequence[StageGraph]) -> tuple[Tie, ...]:
    """Parameters held by more than one stage (tied weights), with their name inside each stage."""
    canonical: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(param), name)
    params = dict(model.named_parameters(remove_duplicate=False))
    holders: dict[str, dict[int, str]] = {}
    for stage in stages:
        names = [f"{m}.{n}" for m in stage.modules for n, _ in model.get_submodule(m).named_parameters()]
        names += [t for t in stage.tensors if t in params]
        for name in names:
            holders.setdefault(canonical[id(params[name])], {}).setdefault(stage.index, name)
    return tuple(
        Tie(name, tuple(sorted(members.items()))) for name, members in holders.items() if len(members) > 1
    )


def _loss_kind(bundle: Any, gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> str:
    """``cross_entropy`` (pipeplan's default) or ``where:loss_fn`` for a model file's own loss."""
    spec = str(bundle.spec)
    loss_fn = bundle.loss_fn
    if (
        getattr(loss_fn, "__name__", "") == "default_loss"
        and loss_fn.__module__ == "partitioner.models.specs"
    ):
        return "cross_entropy"
    where = spec.rpartition(":")[0]
    if where and getattr(loss_fn, "__name__", "") == "loss_fn":
        return f"{_absolute(where)}:loss_fn"
    raise PackageError(
        f"{spec}: the package cannot express loss {getattr(loss_fn, '__qualname__', loss_fn)!r}; "
        "define loss_fn(output, target) at the top of the model file"
    )


def _absolute(where: str) -> str:
    return str(Path(where).expanduser().resolve()) if where.endswith(".py") or "/" in where else where


def _check_weights(weights: str, model: nn.Module) -> None:
    """Every parameter must be in the weights (a tied one under any of its names)."""
    from runtime.building.weight_files import missing

    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    try:
        gaps = missing(weights, aliases.values())
    except Exception as exc:
        raise PackageError(f"cannot read weights {weights}: {type(exc).__name__}: {exc}") from exc
    if gaps:
        raise PackageError(
            f"weights {weights} lack {len(gaps)} parameters, e.g. {gaps[0]}; save model.state_dict() "
            "(or save_pretrained)"
        )


def _extra(
    gm: fx.GraphModule,
    bundle: Any,
    stages: Sequence[StageGraph],
    names: Mapping[str, str],
    loss: str,
    weights: str | None,
    tracer: str,
    init: str,
    reshaped: bool,
    output: Any,
) -> dict[str, Any]:
    """plan.json's ``extra`` of a package; ``output``: the graph's (from an empty batch: shapes only)."""
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    logits = stagekit.loss_input(output)
    classes = int(logits.shape[-1]) if logits.dim() > 1 else len(bundle.inputs[0])  # output classes
    inputs, targets = _data_specs(bundle, placeholders, classes)
    return {
        "inputs": inputs,
        "targets": targets,
        "example_functions": _example_functions(bundle, reshaped),
        "loss": loss,
        "keyword_inputs": bool(getattr(bundle, "input_names", ())),
        "init": f"checkpoint {weights}" if weights else init,
        "tracer": tracer,
        "static_batch_size": len(bundle.inputs[0]) if _static(gm) else None,
        "stage_inputs": [[names[n] for n in s.in_names] for s in stages],
        "stage_outputs": [[names[n] for n in s.out_names] for s in stages],
        "tensor_names": {pipedream: name for name, pipedream in names.items()},
    }


def _static(gm: fx.GraphModule) -> bool:
    """Whether the graph only runs at the batch size it was traced at (torch.export with static shapes)."""
    has_symbols = any(
        isinstance(n.meta.get("val"), torch.SymInt) or "sym_size" in str(n.target) for n in gm.graph.nodes
    )
    exported = any("val" in n.meta for n in gm.graph.nodes if n.op == "placeholder")
    return exported and not has_symbols


def _described(name: str, t: torch.Tensor) -> dict[str, Any]:
    return {"name": name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def _tensor_spec(name: str, t: torch.Tensor, vocabulary: int | None) -> dict[str, Any]:
    """How to make more tensors like ``t`` for synthetic data (``stagekit.make_inputs`` reads it).

    Integers keep their meaning: a constant (an all-ones attention mask) stays that constant, token
    ids range over the ``vocabulary`` where it is known, other integers stay below the largest value
    seen (position ids, say: a range a model surely accepts).
    """
    spec = _described(name, t)
    if t.is_floating_point() or t.is_complex():
        return spec
    flat = t.reshape(-1)
    if flat.numel() > 1 and bool((flat == flat[0]).all()):
        spec["fill"] = flat[0].item()
    else:
        spec["high"] = vocabulary or (int(t.max()) + 1 if t.numel() else 2)
    return spec


def _data_specs(bundle: Any, names: Sequence[str], classes: int) -> tuple[list[Any], dict[str, Any]]:
    """The (inputs, targets) specs the package draws synthetic data from: a built-in or ``hf:``
    model's own (the profile drew its inputs from them), else read off the example tensors."""
    if getattr(bundle, "data", None) is None:
        targets = _target_spec(bundle, classes)
        return _input_specs(bundle, names, targets, classes), targets
    specs, target = bundle.data
    inputs = [
        _positions_checked({**spec, "name": name, "shape": list(t.shape)}, bundle.module)
        for spec, name, t in zip(specs, names, bundle.inputs, strict=True)
    ]
    return inputs, {**target, "shape": list(bundle.targets.shape)}


def _positions_checked(spec: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """Keep an input's ``max_length`` (the positions a run's ``--seq-len`` may not exceed) only when
    the model has a learned position table of that size (gpt2's ``wpe``, bert's ``position_embeddings``,
    with the offset some add): rotary and ALiBi models run longer sequences, and are not refused."""
    limit = spec.get("max_length")
    if limit is None:
        return spec
    tables = [
        m.num_embeddings
        for name, m in model.named_modules()
        if isinstance(m, nn.Embedding) and ("pos" in name.rsplit(".", 1)[-1] or name.endswith("wpe"))
    ]
    if any(limit <= rows <= limit + 2 for rows in tables):
        return spec
    return {k: v for k, v in spec.items() if k != "max_length"}


def _input_specs(bundle: Any, names: Sequence[str], targets: Mapping[str, Any], classes: int) -> list[Any]:
    """Token ids whose range is known: the first input when the targets are its next tokens (so the
    output's classes are its vocabulary), and ``*input_ids`` of a model whose config has a
    ``vocab_size`` (Hugging Face)."""
    config_vocab = getattr(getattr(bundle.module, "config", None), "vocab_size", None)
    specs = []
    for i, (name, t) in enumerate(zip(names, bundle.inputs, strict=True)):
        vocabulary = classes if i == 0 and targets["kind"] == "next_token" else None
        if vocabulary is None and name.endswith("input_ids") and isinstance(config_vocab, int):
            vocabulary = config_vocab
        specs.append(_tensor_spec(name, t, vocabulary))
    return specs


def _target_spec(bundle: Any, classes: int) -> dict[str, Any]:
    """Targets: next tokens of the first input, classes over all the output's ``classes``, or normal."""
    from partitioner.models.specs import next_token_targets

    t = bundle.targets
    spec = _described("target", t)
    first = bundle.inputs[0]
    if first.shape == t.shape and not first.is_floating_point() and torch.equal(next_token_targets(first), t):
        spec["kind"] = "next_token"
    elif t.is_floating_point():
        spec["kind"] = "normal"
    else:
        spec.update(high=classes, kind="classes")
    return spec


def _example_functions(bundle: Any, reshaped: bool) -> list[str | None]:
    """The model file's ``[example_inputs, example_targets]`` as ``where:name`` where it defines them
    (the package calls them, so its synthetic data are the user's), else None each. With
    ``--input-shape`` (``reshaped``) the inputs are drawn at that shape instead, as the profiler did."""
    where, sep, _ = str(bundle.spec).rpartition(":")
    if not sep or where == "torchvision":
        return [None, None]
    found: list[str | None] = []
    for name in ("example_inputs", "example_targets"):
        if reshaped and name == "example_inputs":
            found.append(None)
            continue
        full = f"{_absolute(where)}:{name}"
        try:
            found.append(full if callable(stagekit.factory_from_spec(full)) else None)
        except (ImportError, AttributeError, ValueError, UserFileError):
            found.append(None)
    return found


# ---------------------------------------------------------------- files


def _json(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, indent=1) + "\n"


def _keep_runs(out_dir: Path, tmp: Path) -> None:
    """A package being replaced may hold training runs (metrics, checkpoints of its stages): move them
    into the new package as ``runs.<time of the old plan>`` (``run.<time>`` for an older package's
    ``run/``) rather than deleting them. They belong to the old stages, so they do not stay where
    ``pipeplan run --resume`` and ``calibrate`` look."""
    for old_run in sorted(out_dir.glob("run*")) if out_dir.is_dir() else ():
        if old_run.is_symlink() or not old_run.is_dir() or (tmp / old_run.name).exists():
            continue  # the ``run`` link to the newest of ``runs/`` is dropped with the old folder
        name = old_run.name
        if name in ("run", "runs"):
            stamp = (out_dir / "plan.json").stat().st_mtime if (out_dir / "plan.json").exists() else 0.0
            name += "." + time.strftime("%Y%m%d-%H%M%S", time.localtime(stamp))
        log.info("the replaced package's %s is kept as %s", old_run, out_dir / name)
        old_run.rename(tmp / name)


def kept_runs(out_dir: Path) -> set[str]:
    """The names of the runs of replaced plans a package folder keeps (``runs.<time>``,
    ``run.<time>``): what :func:`_keep_runs` moved, for the command to say so in its last line."""
    found = out_dir.glob("run*.*") if out_dir.is_dir() else ()
    return {p.name for p in found if p.is_dir() and not p.is_symlink()}


def _write_folder(out_dir: Path, files: Mapping[str, str], keep_existing: bool = False) -> None:
    """Write all files into a temporary sibling folder, then swap it in (a reader never sees half).
    A package a ``pipeplan run`` is training is left alone (its run folder is locked)."""
    training = holder(out_dir / "run")
    if training:
        raise PipeplanError(
            f"{out_dir} is being trained by `pipeplan run` ({training}); wait for it to end, or "
            "partition into another folder with -o"
        )
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        if keep_existing and out_dir.is_dir():
            shutil.copytree(out_dir, tmp, symlinks=True, dirs_exist_ok=True)
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        _keep_runs(out_dir, tmp)
        old = out_dir.with_name(f".{out_dir.name}.old")
        if out_dir.exists():
            shutil.rmtree(old, ignore_errors=True)
            out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        raise PipeplanError(f"cannot write package {out_dir}: {exc.strerror or exc}") from exc
