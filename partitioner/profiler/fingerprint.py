"""A layer's fingerprint: everything that decides what it costs, so that twins share one measurement.

The 32 decoder blocks of a Llama run the same operations on inputs and weights of the same shapes:
measuring each of them again costs 32 times the time and tells nothing new. Two layers are twins
when their graph code is the same once node and attribute names are replaced by positions
(``model.layers.3.mlp.up_proj`` and ``model.layers.17.mlp.up_proj`` read alike), the parameters
and buffers they use have the same shapes, dtypes and trainability, their inputs the same shapes
and dtypes (and autograd differentiates the same ones: the backward depends on it), and their
non-tensor inputs the same values. A module kept whole (``--leaf-module``) is described by its
class, its ``repr`` and its tensors' shapes.

What the hash cannot see, it cannot tell apart: a leaf module whose forward depends on a Python
attribute its ``repr`` hides (a per-layer flag), or data-dependent control flow. ``pipeplan profile
--no-reuse`` measures every layer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from torch import Tensor, fx, nn
from torch.utils._pytree import tree_flatten

__all__ = ["fingerprint"]


def fingerprint(
    gm: nn.Module, members: Sequence[fx.Node], values: Mapping[fx.Node, Any], grad: Collection[str]
) -> str:
    """A hash of what decides the cost of the layer made of ``members``.

    Args:
        gm: the traced graph the members belong to (their attributes and submodules).
        members: the layer's graph nodes, in graph order.
        values: values of the layer's inputs (nodes outside ``members``), as the interpreter holds them.
        grad: names of the nodes whose values autograd differentiates in a training step.
    """
    local = {m: i for i, m in enumerate(members)}
    outside: dict[fx.Node, int] = {}

    def ref(arg: Any) -> Any:
        if not isinstance(arg, fx.Node):
            return arg
        if arg in local:
            return ("local", local[arg])
        if arg not in outside:
            outside[arg] = len(outside)
        return ("in", outside[arg], describe(values.get(arg)), arg.name in grad)

    lines = []
    for m in members:
        args = fx.node.map_aggregate((m.args, m.kwargs), ref)
        read_outside = any(u not in local for u in m.users)
        lines.append(repr((m.op, _target(gm, m), args, read_outside, m.name in grad)))
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()


def describe(value: Any) -> Any:
    """Shape, dtype and trainability of every tensor in ``value``; other leaves as themselves."""
    leaves, spec = tree_flatten(value)
    return (
        str(spec),
        tuple(
            ("tensor", tuple(t.shape), str(t.dtype), t.requires_grad) if isinstance(t, Tensor) else repr(t)
            for t in leaves
        ),
    )


def _target(gm: nn.Module, node: fx.Node) -> Any:
    """The node's target without its name: an attribute's tensor, a submodule's class and tensors."""
    if node.op == "get_attr":
        value: Any = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        return ("attr", isinstance(value, nn.Parameter), describe(value))
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        tensors = [
            (name, tuple(t.shape), str(t.dtype), t.requires_grad)
            for name, t in [*sub.named_parameters(), *sub.named_buffers()]
        ]
        return (f"{type(sub).__module__}.{type(sub).__qualname__}", " ".join(repr(sub).split()), tensors)
    if node.op == "call_function":
        target = node.target
        name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', str(target))}"
        overload = getattr(target, "_overloadname", None)  # aten.mm.default and aten.mm.out share a name
        return f"{name}.{overload}" if overload else name
    if node.op in ("placeholder", "output"):
        return node.op
    return str(node.target)
