"""Modules kept whole under torch.export: one ``call_module`` node each, run eagerly inside its stage.

torch.export traces every module down to aten ops, and refuses a module whose Python branches on a
tensor's value (a mixture-of-experts loop over the experts a batch hit, ``if mask.any():``): a guard
on a data-dependent value. torch.fx has leaf modules for this; torch.export has none. So here a leaf
module's ``forward`` is swapped, while the model is exported, for one opaque custom op
(``pipeplan::leaf_module``) whose output shapes come from one real call of the module, and after the
export that op is written back as a ``call_module`` of the original module: the graph a torch.fx
leaf would give. Its stage holds the module and runs its Python as it is, on the real values.

The shapes: one forward of the whole model on the example inputs records, per leaf module, its
inputs and outputs; each output size is tied to the input size it equals (same position first), so
a dynamic batch or sequence length flows through the op as a symbol, and every other size is a
constant. That forward needs real weights: a model built without them (``partition``'s weightless
re-trace) cannot run it, and :func:`recorded` raises, so the caller builds the model whole.

:func:`branching_module` reads a failed export's traceback for the module whose code branched, so
the tracer can keep it whole and try again.

Example:
    >>> with leaf_calls(model, ["DbrxExperts"], lambda: model(**inputs)):  # doctest: +SKIP
    ...     program = torch.export.export(model, (), inputs, strict=False)
    >>> gm = program.module(); rewrite_leaf_calls(gm)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, fx, nn

__all__ = ["Branch", "branching_module", "leaf_calls", "rewrite_leaf_calls"]


@dataclass(frozen=True)
class _Record:
    """One real call of a leaf module: what its outputs are, and how their sizes follow its inputs."""

    out_spec: pytree.TreeSpec
    out_consts: tuple[Any, ...]  # per output leaf: the value, or _TENSOR for a tensor
    out_paths: tuple[tuple[Any, ...], ...]  # per tensor output: its key path in the output
    out_dtypes: tuple[torch.dtype, ...]
    out_sizes: tuple[tuple[tuple[int, int] | int, ...], ...]  # per dim: (input, dim) or a constant


@dataclass(frozen=True)
class _Call:
    """One traced call of a leaf module: how to rebuild its arguments around the op's inputs."""

    module: nn.Module
    path: str
    spec: pytree.TreeSpec
    kinds: tuple[str, ...]  # per argument leaf: tensor, int, bool or const
    consts: tuple[Any, ...]
    record: _Record


_TENSOR = object()  # (an output leaf that is a tensor: None is a value a module may return)
_CALLS: list[_Call] = []  # the calls of the export under way (one at a time: tracing holds the GIL)


@torch.library.custom_op("pipeplan::leaf_module", mutates_args=())
def _leaf_module(key: int, tensors: list[Tensor], ints: list[int]) -> list[Tensor]:
    """The module's own forward (what the ``call_module`` that replaces this op runs)."""
    call = _CALLS[key]
    args, kwargs = _arguments(call, tensors, ints)
    flat = pytree.tree_leaves(type(call.module).forward(call.module, *args, **kwargs))
    inputs = {id(t) for t in tensors}
    return [t.clone() if id(t) in inputs else t for t in flat if isinstance(t, Tensor)]


@_leaf_module.register_fake
def _leaf_module_fake(key: int, tensors: list[Tensor], ints: list[int]) -> list[Tensor]:
    record = _CALLS[key].record
    device = tensors[0].device if tensors else torch.device("cpu")
    out = []
    for dtype, sizes in zip(record.out_dtypes, record.out_sizes, strict=True):
        shape = [tensors[s[0]].shape[s[1]] if isinstance(s, tuple) else s for s in sizes]
        out.append(torch.empty(shape, dtype=dtype, device=device))
    return out


def _arguments(call: _Call, tensors: Sequence[Any], ints: Sequence[Any]) -> tuple[Any, Any]:
    it_t, it_i = iter(tensors), iter(ints)
    leaves = []
    for kind, const in zip(call.kinds, call.consts, strict=True):
        if kind == "tensor":
            leaves.append(next(it_t))
        elif kind in ("int", "bool"):
            value = next(it_i)
            leaves.append(bool(value) if kind == "bool" and isinstance(value, int) else value)
        else:
            leaves.append(const)
    return pytree.tree_unflatten(leaves, call.spec)  # type: ignore[no-any-return]


def _sizes(out: Tensor, inputs: Sequence[Tensor]) -> tuple[tuple[int, int] | int, ...]:
    """Each size of ``out`` as the input size it equals (same rank and position first), else itself."""
    sizes: list[tuple[int, int] | int] = []
    for d, v in enumerate(out.shape):
        same = [(j, d) for j, t in enumerate(inputs) if t.dim() == out.dim() and t.shape[d] == v]
        anywhere = [(j, e) for j, t in enumerate(inputs) for e, w in enumerate(t.shape) if w == v]
        found = same or anywhere
        sizes.append(found[0] if found else int(v))
    return tuple(sizes)


def _record(args: Any, kwargs: Any, output: Any) -> _Record:
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    with_paths, spec = pytree.tree_flatten_with_path(output)
    tensors = [(p, t) for p, t in with_paths if isinstance(t, Tensor)]
    return _Record(
        spec,
        tuple(_TENSOR if isinstance(t, Tensor) else t for _, t in with_paths),
        tuple(tuple(p) for p, _ in tensors),
        tuple(t.dtype for _, t in tensors),
        tuple(_sizes(t, inputs) for _, t in tensors),
    )


def _instances(model: nn.Module, classes: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """Every module of a leaf class that no other leaf module holds (the outermost are the calls)."""
    names = set(classes)
    found: list[tuple[str, nn.Module]] = []
    for path, m in model.named_modules():
        cls = type(m)
        leaf = path and {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"} & names
        if leaf and not any(path.startswith(f"{p}.") for p, _ in found):
            found.append((path, m))
    return found


def recorded(instances: Sequence[tuple[str, nn.Module]], run: Callable[[], Any]) -> dict[int, _Record]:
    """One real forward (``run``): each leaf module's last call, by ``id`` of the module.

    Raises:
        RuntimeError: the forward cannot run for real (a model without its weights).
    """
    records: dict[int, _Record] = {}

    def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        records[id(module)] = _record(args, kwargs, output)

    handles = [m.register_forward_hook(hook, with_kwargs=True) for _, m in instances]
    try:
        with torch.no_grad():
            run()
    except Exception as exc:
        raise RuntimeError(f"keeping modules whole needs one real forward: {exc}") from exc
    finally:
        for h in handles:
            h.remove()
    return records


@contextlib.contextmanager
def leaf_calls(model: nn.Module, classes: Sequence[str], run: Callable[[], Any]) -> Iterator[None]:
    """Within the block, each module of ``classes`` calls ``pipeplan::leaf_module`` instead of tracing
    its ``forward``; ``run`` is one real forward of the model, for the shapes of their outputs.
    :func:`rewrite_leaf_calls` of the exported graph belongs inside the block too."""
    instances = _instances(model, classes)
    if not instances:
        yield
        return
    records = recorded(instances, run)
    for path, module in instances:
        if id(module) in records:
            module.forward = _traced_forward(module, path, records[id(module)])
    try:
        yield
    finally:
        for _, module in instances:
            module.__dict__.pop("forward", None)
        _CALLS.clear()  # (rewrite_leaf_calls reads them inside the block; nothing does after)


def _traced_forward(module: nn.Module, path: str, record: _Record) -> Callable[..., Any]:
    original = type(module).forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        kinds = tuple(_kind(v) for v in leaves)
        tensors = [v for v, k in zip(leaves, kinds, strict=True) if k == "tensor"]
        ints = [
            _as_int(v) if k == "bool" else v
            for v, k in zip(leaves, kinds, strict=True)
            if k in ("int", "bool")
        ]
        consts = tuple(None if k != "const" else v for v, k in zip(leaves, kinds, strict=True))
        _CALLS.append(_Call(module, path, spec, kinds, consts, record))
        outs = iter(_leaf_module(len(_CALLS) - 1, tensors, ints))
        flat = [next(outs) if c is _TENSOR else c for c in record.out_consts]
        return pytree.tree_unflatten(flat, record.out_spec)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    return forward


def _as_int(flag: Any) -> Any:
    """A traced bool as the op can take it: an int (``sym_ite``: the op's schema has no SymBool)."""
    return torch.sym_ite(flag, 1, 0) if isinstance(flag, torch.SymBool) else int(flag)  # type: ignore[no-untyped-call]


def _kind(value: Any) -> str:
    if isinstance(value, Tensor):
        return "tensor"
    if isinstance(value, (bool, torch.SymBool)):
        return "bool" if isinstance(value, torch.SymBool) else "const"
    if isinstance(value, torch.SymInt):
        return "int"
    return "const"


def rewrite_leaf_calls(gm: fx.GraphModule) -> int:
    """Every ``pipeplan::leaf_module`` node of an exported graph as a ``call_module`` of the module,
    its outputs read from what the module returns; the module installed in ``gm`` at its path.
    Returns how many calls were rewritten."""
    graph, done = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.pipeplan.leaf_module.default:
            continue
        call = _CALLS[int(node.args[0])]
        ints = [_unwrap_bool(a) for a in node.args[2]]
        args, kwargs = _arguments(call, node.args[1], ints)
        _install(gm, call.path, call.module)  # (before the node that names it)
        with graph.inserting_before(node):
            module_node = graph.call_module(call.path, tuple(args), dict(kwargs))
        module_node.meta = {k: v for k, v in node.meta.items() if k != "val"}
        for user in list(node.users):
            index = user.args[1] if user.target is operator.getitem else None
            if index is None:
                raise RuntimeError(f"the output of {call.path} is read whole ({user.format_node()})")
            with graph.inserting_before(user):
                value = _read(graph, module_node, call.record.out_paths[int(index)])
            value.meta = dict(user.meta)
            user.replace_all_uses_with(value)
            graph.erase_node(user)
        graph.erase_node(node)
        for a in node.args[2]:  # the bools' conversions to ints, read by the op only
            if isinstance(a, fx.Node) and a.target is torch.sym_ite and not a.users:
                graph.erase_node(a)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done


def _unwrap_bool(arg: Any) -> Any:
    """The bool a ``sym_ite(b, 1, 0)`` argument was made from (the module is called with the bool)."""
    return arg.args[0] if isinstance(arg, fx.Node) and arg.target is torch.sym_ite else arg


def _read(graph: fx.Graph, node: fx.Node, path: tuple[Any, ...]) -> fx.Node:
    for key in path:
        if isinstance(key, pytree.GetAttrKey):
            node = graph.call_function(getattr, (node, key.name))
        else:
            index = key.idx if isinstance(key, pytree.SequenceKey) else key.key
            node = graph.call_function(operator.getitem, (node, index))
    return node


def _install(gm: fx.GraphModule, path: str, module: nn.Module) -> None:
    owner: nn.Module = gm
    *parents, leaf = path.split(".")
    for name in parents:
        if not hasattr(owner, name):
            owner.add_module(name, nn.Module())
        owner = getattr(owner, name)
    setattr(owner, leaf, module)


@dataclass(frozen=True)
class Branch:
    """Where a failed trace branched on a value: the module doing it and the model's line."""

    path: str
    cls: str
    file: str
    line: int

    def where(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"


def branching_module(exc: BaseException, model: nn.Module) -> Branch | None:
    """The innermost module of ``model`` whose code was running when ``exc`` was raised, with the
    innermost line of code outside torch: what a data-dependent guard points at."""
    paths = {id(m): p for p, m in model.named_modules()}
    found: Branch | None = None
    for tb in _tracebacks(exc):  # the outermost exception first, its causes after: the last is deepest
        module: nn.Module | None = None
        line: tuple[str, int] | None = None
        for frame, lineno in _frames(tb):
            file = frame.f_code.co_filename
            if f"{os.sep}torch{os.sep}" in file:
                continue
            line = (file, lineno)
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in paths:
                module = owner
        if module is not None and line is not None:
            found = Branch(paths[id(module)], type(module).__name__, *line)
    return found


def _tracebacks(exc: BaseException) -> Iterator[TracebackType]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current.__traceback__ is not None:
            yield current.__traceback__
        current = current.__cause__ or current.__context__


def _frames(tb: TracebackType) -> Iterator[tuple[Any, int]]:
    current: TracebackType | None = tb
    while current is not None:
        yield current.tb_frame, current.tb_lineno
        current = current.tb_next
