"""Inline the grad-mode and autocast regions torch.export wraps into submodules.

torch.export keeps a ``with torch.no_grad():`` (or ``torch.autocast``) block, such as a rotary
embedding's ``@torch.no_grad()`` forward, as a higher-order op calling a generated submodule
(``wrap_with_set_grad_enabled(False, submod_1, *operands)``). That submodule is no module of the
model, so a stage that holds it could not be rebuilt from the model's own modules, and a cut could
not fall inside it. Inlining the region's ops into the graph keeps the values exact; a region run
without gradients gets ``detach`` on its outputs, so autograd treats them exactly as ``no_grad`` did.

Example:
    >>> inline_wrapped_regions(exported_graph_module)  # doctest: +SKIP
    1
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch import fx

from partitioner.errors import TraceError

__all__ = ["inline_wrapped_regions"]

log = logging.getLogger(__name__)


def _wrappers() -> dict[Any, str]:
    ops = torch.ops.higher_order
    found = {}
    for name in ("wrap_with_set_grad_enabled", "wrap_with_autocast"):
        op = getattr(ops, name, None)
        if op is not None:
            found[op] = name
    return found


def inline_wrapped_regions(gm: fx.GraphModule) -> int:
    """Replace every wrapped region of ``gm`` by its ops, in place; returns how many were inlined.

    Raises:
        TraceError: a region runs with autocast enabled (inlining would change its precision) or
            reads tensors of its own that the model does not hold.
    """
    wrappers = _wrappers()
    count = 0
    while True:
        node = next((n for n in gm.graph.nodes if n.op == "call_function" and n.target in wrappers), None)
        if node is None:
            break
        _inline(gm, node, wrappers[node.target])
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
        _drop_unused_submodules(gm)
        gm.recompile()
        log.info("inlined %d no_grad/autocast regions of the exported graph", count)
    return count


def _region_parts(node: fx.Node, kind: str) -> tuple[bool, fx.Node, tuple[Any, ...]]:
    """(gradients enabled inside, the submodule's get_attr node, the operands)."""
    if kind == "wrap_with_set_grad_enabled":
        enabled, sub, *operands = node.args
        return bool(enabled), sub, tuple(operands)  # type: ignore[return-value]
    _device, _dtype, enabled, _cache, sub, *operands = node.args
    if enabled:
        raise TraceError(
            f"the model runs {node.name} under torch.autocast; pipeplan inlines only autocast-disabled "
            "regions: keep the module doing it whole with --leaf-module, or drop the autocast block"
        )
    return True, sub, tuple(operands)  # type: ignore[return-value]


def _inline(gm: fx.GraphModule, node: fx.Node, kind: str) -> None:
    grad, sub_node, operands = _region_parts(node, kind)
    sub = getattr(gm, str(sub_node.target))
    if any(n.op == "get_attr" for n in sub.graph.nodes):
        raise TraceError(
            f"the exported region {sub_node.target} holds tensors of its own; keep the module doing it "
            "whole with --leaf-module"
        )
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, operands, strict=True))
    stack = node.meta.get("nn_module_stack")
    results: Any = None
    with gm.graph.inserting_before(node):
        for inner in sub.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                results = fx.map_arg(inner.args[0], env.__getitem__)
                break
            new = gm.graph.node_copy(inner, env.__getitem__)
            if stack and not new.meta.get("nn_module_stack"):
                new.meta["nn_module_stack"] = dict(stack)
            env[inner] = new
        outputs = list(results) if isinstance(results, (tuple, list)) else [results]
        if not grad:
            outputs = [_detached(gm.graph, out, stack) for out in outputs]
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outputs[int(user.args[1])])  # type: ignore[arg-type]
            gm.graph.erase_node(user)
    if node.users:
        raise TraceError(f"the exported region {node.name} is used as a whole; cannot inline it")
    gm.graph.erase_node(node)


def _detached(graph: fx.Graph, value: Any, stack: Any) -> Any:
    if not isinstance(value, fx.Node):
        return value
    out = graph.call_function(torch.ops.aten.detach.default, (value,))
    out.meta = {k: v for k, v in value.meta.items() if k in ("val", "tensor_meta")}
    if stack:
        out.meta["nn_module_stack"] = dict(stack)
    return out


def _drop_unused_submodules(gm: fx.GraphModule) -> None:
    used = {str(n.target) for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    for name, child in list(gm.named_children()):
        if name.startswith("submod_") and isinstance(child, fx.GraphModule) and name not in used:
            delattr(gm, name)
