"""Model -> graph -> layers: torch.fx tracing with leaf-module rules, torch.export as the fallback.

torch.fx keeps torch.nn built-ins (and ``--leaf-module`` classes) as single ``call_module`` nodes, which
are the natural layers of a pipeline. Models fx cannot trace (Hugging Face transformers, data-dependent
Python) go through ``torch.export`` non-strict instead; its aten ops are grouped back into layers with
``node.meta["nn_module_stack"]``. Either way the result is a list of ``Group``s: consecutive graph nodes
that become one profile node. Free ops (views, getattr, size) are folded into a neighbour when that
hides no tensor the optimizer could cut at.

Example:
    >>> from partitioner.models.specs import load_model
    >>> traced = trace_model(load_model("tiny-cnn", batch_size=2))
    >>> traced.tracer, traced.groups[1].name
    ('fx', 'stem')
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from partitioner.errors import TraceError
from partitioner.models.specs import ModelBundle, load_model
from partitioner.profiler.hf_masks import masks_as_eager
from partitioner.profiler.inline import inline_wrapped_regions
from partitioner.profiler.leaf_calls import Branch, branching_module, leaf_calls, rewrite_leaf_calls

__all__ = ["Group", "Traced", "group_nodes", "has_symbolic_shapes", "retrace", "trace_model"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Group:
    """Consecutive graph nodes measured (and later cut) as one layer.

    Attributes:
        id: the first member's node name: stable from one trace to the next.
        name: the module path a person recognises (``features.3``, ``transformer.h.0``).
        op: ``input``, ``output``, ``call_module``, ``call_function``, ``call_method`` or ``get_attr``.
        target: module class or function name.
        members: graph node names in graph order (always includes ``id``).
        description: short human text, e.g. the module's repr.
    """

    id: str
    name: str
    op: str
    target: str
    members: tuple[str, ...]
    description: str = ""


@dataclass(frozen=True)
class Traced:
    """A traced model and its layers.

    Attributes:
        graph_module: the fx GraphModule (from ``symbolic_trace`` or ``torch.export(...).module()``).
        tracer: ``fx`` or ``export``.
        options: what ``retrace`` needs to rebuild the same graph: spec, batch size, input shape,
            leaf modules, tracer.
        groups: the layers, in topological order.
    """

    graph_module: fx.GraphModule
    tracer: str
    options: Mapping[str, Any] = field(default_factory=dict)
    groups: tuple[Group, ...] = ()


def trace_model(
    bundle: ModelBundle,
    leaf_modules: Sequence[str] = (),
    input_shape: tuple[int, ...] | None = None,
    dynamic: bool = True,
) -> Traced:
    """Trace ``bundle.module`` with fx, or with torch.export when fx cannot.

    Args:
        bundle: the model and its example inputs.
        leaf_modules: class names (``GPT2Block``) or qualified class names kept as one layer each.
        input_shape: recorded in the options so ``retrace`` loads the same inputs.
        dynamic: let torch.export try a dynamic batch first (the graph then runs any microbatch);
            False exports at the bundle's shapes, two to three times faster on a deep model.

    Raises:
        TraceError: neither tracer worked (names the module where fx failed) or a leaf name matches nothing.
    """
    leaves = tuple(leaf_modules)
    _check_leaf_names(bundle.module, leaves)
    options: dict[str, Any] = {
        "spec": bundle.spec,
        "batch_size": bundle.batch_size,
        "input_shape": list(input_shape) if input_shape else None,
        "leaf_modules": list(leaves),
    }
    tracer = _FxTracer(leaves)
    try:
        if bundle.input_names:
            raise TraceError("a model called with keyword inputs is traced with torch.export")
        graph = tracer.trace(bundle.module)
        gm = fx.GraphModule(bundle.module, graph, type(bundle.module).__name__)
        kind = "fx"
    except Exception as fx_exc:
        log.info("torch.fx failed (%s); falling back to torch.export", fx_exc)
        gm, leaves = _export(bundle, fx_exc, tracer.failed_in, dynamic, leaves)
        options["leaf_modules"] = list(leaves)
        kind = "export"
    options["tracer"] = kind
    options["static_shapes"] = kind == "export" and not has_symbolic_shapes(gm)
    return Traced(gm, kind, options, group_nodes(gm, kind, leaves))


def retrace(options: Mapping[str, Any], batch_size: int | None = None) -> Traced:
    """Rebuild the graph a profile was measured on, from its ``tracer_options`` (same node names).

    ``batch_size`` overrides the traced one: fx graphs do not depend on it, exported graphs have static
    shapes, so code for a microbatch size is traced at that size.
    """
    shape = options.get("input_shape")
    batch = batch_size or int(options["batch_size"])
    bundle = load_model(str(options["spec"]), batch, tuple(shape) if shape else None)
    dynamic = not options.get("static_shapes")
    leaves = tuple(options.get("leaf_modules", ()))
    traced = trace_model(bundle, leaves, tuple(shape) if shape else None, dynamic=dynamic)
    if traced.tracer != options.get("tracer", traced.tracer):
        raise TraceError(
            f"re-tracing {options['spec']} used {traced.tracer}, the profile used {options['tracer']}"
        )
    return traced


# ---------------------------------------------------------------- tracing


class _FxTracer(fx.Tracer):
    """fx's tracer plus user leaf classes, remembering which module it was inside when tracing failed."""

    def __init__(self, leaf_modules: Sequence[str]) -> None:
        super().__init__()
        self.leaf_modules = set(leaf_modules)
        self.path: list[tuple[str, str]] = []
        self.failed_in: tuple[str, str] | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        cls = type(m)
        if {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"} & self.leaf_modules:
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        self.path.append((self.path_of_module(m), type(m).__name__))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.path[-1]
            raise
        finally:
            self.path.pop()


def _check_leaf_names(module: nn.Module, leaves: Sequence[str]) -> None:
    known = set()
    for m in module.modules():
        known |= {type(m).__name__, f"{type(m).__module__}.{type(m).__qualname__}"}
    missing = [name for name in leaves if name not in known]
    if missing:
        classes = sorted({type(m).__name__ for m in module.modules()})
        raise TraceError(
            f"--leaf-module {missing[0]} matches no module of the model; its classes: {', '.join(classes)}"
        )


_MAX_KEPT = 8
"""How many module classes an export keeps whole, one more after each data-dependent failure."""


def _export(
    bundle: ModelBundle,
    fx_exc: Exception,
    failed_in: tuple[str, str] | None,
    dynamic: bool = True,
    leaves: Sequence[str] = (),
) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """torch.export, keeping whole the leaf modules and every module found to branch on a value.

    Each ``leaves`` class is one ``call_module`` in the graph, run eagerly by its stage
    (:mod:`partitioner.profiler.leaf_calls`), as torch.fx keeps its leaf modules. When the export
    fails on a guard on a tensor's value (``.item()``, ``nonzero`` in a Python branch or loop), the
    module whose code branched is kept whole too and the export runs again; the classes kept are
    returned, so a re-trace (``retrace``, ``partition``) keeps the same ones.
    """
    kept = list(leaves)
    while True:
        try:
            return _export_once(bundle, dynamic, kept), tuple(kept)
        except Exception as exc:
            branch = branching_module(exc, bundle.module) if _data_dependent(exc) else None
            if branch is None or not branch.path or branch.cls in kept or len(kept) >= _MAX_KEPT:
                raise _cannot_trace(bundle, fx_exc, failed_in, exc, branch, kept) from exc
            log.warning(
                "%s (%s) branches on a tensor's value at %s: kept whole, one layer run eagerly in its "
                "stage (as --leaf-module %s)", branch.path, branch.cls, branch.where(), branch.cls,
            )  # fmt: skip
            kept.append(branch.cls)


def _export_once(bundle: ModelBundle, dynamic: bool, leaves: Sequence[str]) -> fx.GraphModule:
    """torch.export non-strict, the batch dimension dynamic where the model allows it.

    With a dynamic batch the graph runs any microbatch or replica share of a minibatch; the batch size
    becomes a ``sym_size`` of an input that :mod:`partitioner.generation.split` reads again, in each stage,
    from a tensor that stage receives. A model that fixes its batch size is exported with static shapes, and
    ``retrace(options, batch_size=...)`` re-exports it at the size a stage runs (same node names).
    """
    args, kwargs = _export_args(bundle.inputs, bundle)
    with leaf_calls(bundle.module, leaves, lambda: bundle.module(*args, **(kwargs or {}))):
        with _quiet_torch_logs(), _no_stack_traces(), masks_as_eager(bundle.spec):
            try:
                if not dynamic:
                    raise TraceError("static shapes asked for")
                program = _export_dynamic(bundle)
            except Exception as exc:
                if _data_dependent(exc):
                    raise
                log.info("export with a dynamic batch failed (%s); exporting with static shapes", exc)
                program = torch.export.export(bundle.module, args, kwargs, strict=False)
        gm = program.module()
        rewrite_leaf_calls(gm)
    inline_wrapped_regions(gm)
    return gm


def _data_dependent(exc: BaseException) -> bool:
    """Whether an export failed on a guard on a tensor's value (not on a shape or an unsupported op)."""
    current: BaseException | None = exc
    for _ in range(8):
        if current is None:
            return False
        if "DataDependent" in type(current).__name__ or "data-dependent" in str(current)[:2000]:
            return True
        current = current.__cause__ or current.__context__
    return False


def _cannot_trace(
    bundle: ModelBundle,
    fx_exc: Exception,
    failed_in: tuple[str, str] | None,
    exc: Exception,
    branch: Branch | None,
    kept: Sequence[str],
) -> TraceError:
    """One line: what failed, where the model's code branched, and the option that would help."""
    if isinstance(exc, TraceError):
        return exc
    if branch is not None:
        advice = (
            f"--leaf-module CLASS naming a module that holds {branch.cls}"
            if branch.cls in kept or not branch.path
            else f"--leaf-module {branch.cls}"
        )
        return TraceError(
            f"cannot trace {bundle.spec}: {branch.path or '<root>'} ({branch.cls}) branches on a tensor's "
            f"value at {branch.file}:{branch.line} ({_first_line(exc)}); keep it whole with {advice}"
        )
    where = f" in module {failed_in[0] or '<root>'} ({failed_in[1]})" if failed_in else ""
    hint = f"--leaf-module {failed_in[1]}" if failed_in else "--leaf-module CLASS on the module doing it"
    return TraceError(
        f"cannot trace {bundle.spec}: torch.fx failed{where}: {_first_line(fx_exc)}; "
        f"torch.export failed: {_first_line(exc)}; keep that module whole with {hint}"
    )


def _export_dynamic(bundle: ModelBundle) -> torch.export.ExportedProgram:
    """Export at a batch of at least 2 (a size-1 dimension would be specialised) with dim 0 automatic,
    and every dimension of integer inputs (token ids, masks: the sequence length too) where the model
    allows it; if that fails, the batch alone."""
    inputs = bundle.inputs if bundle.batch_size >= 2 else bundle.make_inputs(2)
    auto = torch.export.Dim.AUTO
    args, kwargs = _export_args(inputs, bundle)

    def export(every: bool) -> torch.export.ExportedProgram:
        dims = [
            ({i: auto for i in range(t.dim())} if every and not t.is_floating_point() else {0: auto})
            if t.dim() > 0
            else None
            for t in inputs
        ]
        shapes: Any = dict(zip(bundle.input_names, dims, strict=True)) if bundle.input_names else tuple(dims)
        return torch.export.export(bundle.module, args, kwargs, dynamic_shapes=shapes, strict=False)

    if any(t.dim() > 1 and not t.is_floating_point() for t in inputs):
        try:
            return export(every=True)
        except Exception as exc:
            log.info("export with dynamic sequence lengths failed (%s); the batch alone is dynamic", exc)
    return export(every=False)


def _export_args(
    inputs: tuple[torch.Tensor, ...], bundle: ModelBundle
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor] | None]:
    """Positional inputs, or keyword inputs for models called by name (Hugging Face)."""
    if bundle.input_names:
        return (), dict(zip(bundle.input_names, inputs, strict=True))
    return inputs, None


def has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    """Whether an exported graph computes with a symbolic (dynamic) size anywhere."""
    return any(isinstance(n.meta.get("val"), torch.SymInt) for n in gm.graph.nodes) or any(
        isinstance(d, torch.SymInt)
        for n in gm.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor)
        for d in n.meta["val"].shape
    )


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export prints graph dumps and logs warnings when it fails; the TraceError says what matters."""
    loggers = [
        logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.startswith("torch")
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Tracing records no Python stack per graph node (torch.fx's ``do_not_emit_stack_traces``).

    Capturing and symbolising a traceback for every node took a fifth of a static export of a
    32-block Llama (benchmarks/bench_profile_phases.py), growing with the depth; nothing here reads
    ``stack_trace`` (layers are grouped by ``nn_module_stack``, and the stage code carries no stack
    comments). What is lost: the "Original traceback" torch adds to an error raised while a traced
    graph runs. torch before 2.12 has no such setting: there tracing records the stacks, as it did.
    """
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):
        yield
        return
    previous = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = previous


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


# ---------------------------------------------------------------- grouping

_FREE_FUNCTIONS = {getattr, operator.getitem, torch.flatten, torch.Tensor.size}
_FREE_METHODS = {
    "size", "dim", "view", "reshape", "flatten", "contiguous", "unsqueeze", "squeeze", "expand",
    "permute", "transpose", "split", "chunk", "type_as", "to", "detach", "unflatten",
}  # fmt: skip
_FREE_ATEN = re.compile(
    r"^aten\.(view|_unsafe_view|reshape|unsqueeze|squeeze|permute|transpose|t|expand|slice|select|split|"
    r"alias|detach|sym_size|_assert_tensor_metadata|clone|contiguous)\b"
)


def _is_free(node: fx.Node) -> bool:
    """Ops that cost nothing and copy nothing: views, shape queries, attribute and item access."""
    if node.op == "get_attr" or (node.op == "call_module" and node.target == "_guards_fn"):
        return True
    if node.op == "call_method":
        return str(node.target) in _FREE_METHODS
    if node.op == "call_function":
        return node.target in _FREE_FUNCTIONS or bool(_FREE_ATEN.match(str(node.target)))
    return False


def group_nodes(gm: fx.GraphModule, tracer: str, leaf_modules: Sequence[str] = ()) -> tuple[Group, ...]:
    """Split the graph into layers: one per node (fx) or per module run (export), free ops folded in."""
    nodes = list(gm.graph.nodes)
    units = _module_runs(nodes, set(leaf_modules)) if tracer == "export" else [[n] for n in nodes]
    units = _fold_free(units)
    return tuple(_describe(gm, unit, tracer, leaf_modules) for unit in units)


def _module_key(node: fx.Node, leaves: set[str]) -> str:
    """The module an exported op belongs to: a leaf class, else a numbered block, else the innermost."""
    paths = _stack(node)
    if not paths:
        return ""
    for path, cls in paths:
        if cls in leaves:
            return path
    for path, _ in paths:
        if re.search(r"(^|\.)\d+$", path):
            return path
    return paths[-1][0]


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    """(module path, class name) from the root down; hook placeholders torch.export inserts are skipped."""
    stack = (node.meta.get("nn_module_stack") or {}).values()
    return [
        (str(p), str(c).rsplit(".", 1)[-1]) for p, c in stack if not str(p).startswith("_empty_nn_module")
    ]


def _module_runs(nodes: list[fx.Node], leaves: set[str]) -> list[list[fx.Node]]:
    """Maximal runs of consecutive ops under one module; runs of a linear order keep the graph acyclic."""
    units: list[list[fx.Node]] = []
    last_key: str | None = None
    for node in nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            units.append([node])
            last_key = None
            continue
        key = _module_key(node, leaves)
        if units and key == last_key:
            units[-1].append(node)
        else:
            units.append([node])
        last_key = key
    return units


def _fold_free(units: list[list[fx.Node]]) -> list[list[fx.Node]]:
    """Fold all-free units into their only producer (if they are its only reader) or first consumer."""
    owner = {n: i for i, unit in enumerate(units) for n in unit}
    index = {n: i for i, n in enumerate(n for unit in units for n in unit)}

    def producers(i: int) -> set[int]:
        return {owner[a] for n in units[i] for a in n.all_input_nodes} - {i}

    def consumers(i: int) -> set[int]:
        return {owner[u] for n in units[i] for u in n.users} - {i}

    def foldable(i: int) -> bool:
        return bool(units[i]) and all(_is_free(n) for n in units[i])

    for node in list(owner):  # unpacking stays with what it unpacks: tuples never cross layers
        if node.users and all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
            for user in node.users:
                if owner[user] != owner[node] and len(units[owner[user]]) == 1:
                    _move(units, owner, owner[user], owner[node], index)
    for i in range(len(units)):
        prods = producers(i) if foldable(i) else set()
        if len(prods) == 1:
            (p,) = prods
            if units[p][0].op != "placeholder" and (consumers(p) == {i} or not consumers(i)):
                _move(units, owner, i, p, index)
    for i in reversed(range(len(units))):  # (shape arithmetic read by several layers goes to the first:
        cons = consumers(i) if foldable(i) else set()  # the others read a size, which a cut recomputes)
        if cons and (units[i][0].op == "get_attr" or len(cons) == 1 or _sizes_only(units[i])):
            c = min(cons)
            if units[c][0].op not in ("output", "placeholder"):
                _move(units, owner, i, c, index)
    for i in range(len(units)):  # unused free ops (guards, asserts, dead get_attr) ride with the next layer
        if foldable(i) and not consumers(i):
            after = [j for j in range(i + 1, len(units)) if units[j] and units[j][0].op != "placeholder"]
            if after and units[after[0]][0].op != "output":
                _move(units, owner, i, after[0], index)
    return [unit for unit in units if unit]


def _sizes_only(unit: list[fx.Node]) -> bool:
    """A unit that makes no tensor: torch.export's ``sym_size`` of an input and arithmetic on it."""
    return all(not isinstance(n.meta.get("val"), torch.Tensor) for n in unit) and any(
        isinstance(n.meta.get("val"), torch.SymInt) for n in unit
    )


def _move(
    units: list[list[fx.Node]], owner: dict[fx.Node, int], src: int, dst: int, index: dict[fx.Node, int]
) -> None:
    for n in units[src]:
        owner[n] = dst
    units[dst] = sorted(units[dst] + units[src], key=index.__getitem__)
    units[src] = []


def _describe(gm: fx.GraphModule, unit: list[fx.Node], tracer: str, leaves: Sequence[str]) -> Group:
    head = next((n for n in unit if not _is_free(n)), unit[-1])
    members = tuple(n.name for n in unit)
    if head.op == "placeholder":
        return Group(unit[0].name, head.name, "input", "input", members)
    if head.op == "output":
        return Group(unit[0].name, "output", "output", "output", members)
    if head.op == "call_module" and tracer == "fx":
        sub = gm.get_submodule(str(head.target))
        text = " ".join(repr(sub).split())[:120]
        return Group(unit[0].name, str(head.target), "call_module", type(sub).__name__, members, text)
    if tracer == "export":
        key = _module_key(head, set(leaves))
        cls = _module_class(head, key)
        ops = sorted(
            {str(n.target).removeprefix("aten.").split(".")[0] for n in unit if n.op == "call_function"}
        )
        return Group(
            unit[0].name, key or _root_name(head), "call_module", cls, members, "ops: " + ", ".join(ops)[:120]
        )
    stack = _stack(head)
    prefix = f"{stack[-1][0]}." if stack and stack[-1][0] else ""
    target = getattr(head.target, "__name__", str(head.target))
    return Group(unit[0].name, prefix + head.name, head.op, target, members)


def _root_name(node: fx.Node) -> str:
    """A layer of the model's own ``forward`` (no submodule): the model's class and the op
    (``T5ForConditionalGeneration.mul``), not torch.export's node name (``mul_57``)."""
    stack = _stack(node)
    if not stack:
        return node.name
    op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    return f"{stack[0][1]}.{op}"


def _module_class(node: fx.Node, key: str) -> str:
    for path, cls in _stack(node):
        if path == key:
            return cls
    return getattr(node.target, "__name__", str(node.target))
