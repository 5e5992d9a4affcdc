"""A stage's backward split in two, B (input gradients) and W (weight gradients), without doing
the work twice.

``torch.autograd.grad(roots, params)`` after an input-only pass would run most of the backward
again: the weight gradient of a stage's first layer needs the gradient of every activation after
it. So B, while it computes the input gradients, records the gradient flowing into every autograd
node where the input-gradient path meets a branch that leads only to weights (the *boundary*:
``AddmmBackward`` for a ``Linear``, ``ConvolutionBackward`` for a ``Conv2d``), and W runs, per
boundary node, only its weight branch: ``torch.autograd.grad`` from that node's outputs to its own
weights. This is what the zero-bubble paper's B/W split assumes (each linear layer's dX = dY W^T in
B, dW = X^T dY in W), and how torch.distributed.pipelining splits a stage's backward too.

A weight reached from two boundary nodes (a weight used twice in the stage), from a root directly,
or whose boundary node B did not run, takes the plain way instead: one ``torch.autograd.grad`` from
the roots at W (correct, only slower). The graph stays alive until W: B runs with ``retain_graph``.

Example:
    >>> layer = torch.nn.Linear(3, 2)
    >>> x = torch.randn(4, 3, requires_grad=True)
    >>> (dx,), work = backward_input([layer(x).sum()], [None], [x], list(layer.parameters()))
    >>> grads = backward_weight(work)  # [(layer.weight, dW), (layer.bias, db)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightWork", "backward_input", "backward_weight"]


@dataclass
class WeightWork:
    """What W needs: the roots (which keep the graph alive), and per boundary node the gradient
    B saw flowing into it and the weights only it leads to.

    Attributes:
        roots: the backward's roots (the loss, or the stage's outputs).
        grads: their incoming gradients (None for a scalar loss).
        boundary: (node, gradients into its outputs, its weights) per boundary node.
        rest: weights W takes from the roots (see the module docstring).
    """

    roots: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    boundary: list[tuple[Node, tuple[torch.Tensor | None, ...], list[torch.Tensor]]] = field(
        default_factory=list
    )
    rest: list[torch.Tensor] = field(default_factory=list)


def _nodes(roots: Sequence[torch.Tensor]) -> list[Node]:
    """Every autograd node reachable from ``roots``, each once, in discovery order."""
    seen: dict[Node, None] = {}
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen[node] = None
        stack.extend(n for n, _ in node.next_functions if n is not None and n not in seen)
    return list(seen)


def _reaching(nodes: list[Node], targets: set[Node]) -> set[Node]:
    """The nodes from which some node of ``targets`` is reachable (targets included)."""
    parents: dict[Node, list[Node]] = {}
    for node in nodes:
        for child, _ in node.next_functions:
            if child is not None:
                parents.setdefault(child, []).append(node)
    found, stack = set(targets), list(targets)
    while stack:
        for parent in parents.get(stack.pop(), []):
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found


def _weights_below(node: Node, weights: dict[Node, torch.Tensor]) -> set[Node]:
    """The weight leaves (AccumulateGrad nodes) under ``node``."""
    found, seen, stack = set(), {node}, [node]
    while stack:
        current = stack.pop()
        if current in weights:
            found.add(current)
        for child, _ in current.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return found


def _owners(
    nodes: list[Node], on_path: set[Node], roots: Sequence[torch.Tensor], weights: dict[Node, torch.Tensor]
) -> dict[Node, list[Node]]:
    """Per weight leaf, the input-path nodes with an edge into a weight-only branch above it; a
    root off the input path counts as an owner too (None is never a boundary)."""
    owners: dict[Node, list[Node]] = {leaf: [] for leaf in weights}
    for node in nodes:
        if node not in on_path:
            continue
        for child, _ in node.next_functions:
            if child is not None and child not in on_path:
                for leaf in _weights_below(child, weights):
                    owners[leaf].append(node)
    for root in roots:
        if root.grad_fn is not None and root.grad_fn not in on_path:
            for leaf in _weights_below(root.grad_fn, weights):
                owners[leaf].append(root.grad_fn)
    return owners


def backward_input(
    roots: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], WeightWork]:
    """B: the gradients of ``inputs`` (None where unused), and what W needs for ``params``.

    The graph analysis is plain Python over the stage's autograd nodes, linear in their number
    for the usual shapes (weight branches are a node or two deep)."""
    if not inputs or not roots:
        return (None,) * len(inputs), WeightWork(roots, grads, rest=list(params))
    nodes = _nodes(roots)
    present = set(nodes)
    weights = {torch.autograd.graph.get_gradient_edge(p).node: p for p in params}
    weights = {leaf: p for leaf, p in weights.items() if leaf in present}
    targets = {torch.autograd.graph.get_gradient_edge(t).node for t in inputs}
    on_path = _reaching(nodes, targets & present)
    owners = _owners(nodes, on_path, roots, weights)
    mine: dict[Node, list[torch.Tensor]] = {}
    rest = []
    for leaf, who in owners.items():
        if len(set(who)) == 1 and who[0] in on_path:
            mine.setdefault(who[0], []).append(weights[leaf])
        else:
            rest.append(weights[leaf])
    seen: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def capture(node: Node) -> Any:
        return node.register_prehook(lambda grad_outputs: seen.__setitem__(node, tuple(grad_outputs)))

    handles = [capture(node) for node in mine]
    try:
        got = torch.autograd.grad(roots, list(inputs), grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    work = WeightWork(roots, grads, rest=rest)
    for node, owned in mine.items():
        if node in seen:
            work.boundary.append((node, seen[node], owned))
        else:
            work.rest.extend(owned)
    return got, work


def backward_weight(work: WeightWork) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """W: (weight, gradient) for every weight of ``work`` that got a gradient."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for node, grad_outputs, owned in work.boundary:
        edges = [GradientEdge(node, i) for i, g in enumerate(grad_outputs) if g is not None]
        flowing = [g for g in grad_outputs if g is not None]
        if not edges:
            continue
        got = torch.autograd.grad(edges, owned, flowing, retain_graph=True, allow_unused=True)
        out += [(p, g) for p, g in zip(owned, got, strict=True) if g is not None]
    if work.rest and work.roots:
        got = torch.autograd.grad(work.roots, work.rest, work.grads, retain_graph=True, allow_unused=True)
        out += [(p, g) for p, g in zip(work.rest, got, strict=True) if g is not None]
    return out
