"""The model's output structure: the graph values it is made of, and how the last stage rebuilds it.

A model returns a tensor, a tuple, a dict or a Hugging Face ``ModelOutput``, and a model file's
``loss_fn(output, target)`` reads it as the model returns it (``output.logits``). The traced graph
holds the output's values as leaves: torch.export flattens the output and records a pytree spec
(``_PyTreeCodeGen``), torch.fx keeps the structure itself in its output node. The last stage
returns the same structure, rebuilt in its own code (``return Seq2SeqLMOutput(logits=...,
encoder_last_hidden_state=...)``), so the loss, the evaluation and ``verify`` see what the unsplit
model returns. Every leaf of the output is then computed on, or sent to, the last stage, as the
profile's output node (which reads them all) told the cost model.

Example:
    >>> structure = output_structure(gm)  # doctest: +SKIP
    >>> structure.spec.type.__name__  # doctest: +SKIP
    'CausalLMOutputWithPast'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.utils._pytree as pytree
from torch import fx

from partitioner.errors import PlanError

__all__ = ["OutputStructure", "output_structure", "rebuild"]


@dataclass(frozen=True)
class OutputStructure:
    """The model's output as leaves and a pytree spec.

    Attributes:
        leaves: graph nodes (tensors) and constants, in the spec's leaf order.
        spec: how the leaves nest (a leaf spec when the model returns one tensor).
    """

    leaves: tuple[Any, ...]
    spec: pytree.TreeSpec

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        """The leaves that are graph values (what the last stage computes or receives)."""
        return tuple(leaf for leaf in self.leaves if isinstance(leaf, fx.Node))

    @property
    def is_tensor(self) -> bool:
        """Whether the model returns a bare tensor (no structure to rebuild)."""
        return self.spec.is_leaf()


def output_structure(gm: fx.GraphModule) -> OutputStructure:
    """The leaves and spec of ``gm``'s output: torch.export's recorded spec, or fx's own structure."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    value = out.args[0]
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.out_spec is not None:
        leaves = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        return OutputStructure(leaves, info.out_spec)
    flat, spec = pytree.tree_flatten(value)
    return OutputStructure(tuple(flat), spec)


def rebuild(graph: fx.Graph, structure: OutputStructure, value_of: Callable[[fx.Node], fx.Node]) -> Any:
    """The output expression of a stage graph that returns ``structure`` (leaves mapped by ``value_of``).

    Raises:
        PlanError: the output is of a type the stage's code cannot construct.
    """
    leaves = iter(value_of(v) if isinstance(v, fx.Node) else v for v in structure.leaves)
    return _build(graph, structure.spec, leaves)


def _build(graph: fx.Graph, spec: pytree.TreeSpec, leaves: Any) -> Any:
    if spec.is_leaf():
        return next(leaves)
    children = [_build(graph, child, leaves) for child in spec.children()]
    kind = spec.type
    if kind is type(None):
        return None
    if _is_namedtuple(kind):
        return graph.call_function(kind, tuple(children))
    if issubclass(kind, (tuple, list)):
        return tuple(children) if issubclass(kind, tuple) else list(children)
    if issubclass(kind, dict) and not _keyed(kind):
        return dict(zip(spec.context, children, strict=True))
    if _keyed(kind) and isinstance(spec.context, (list, tuple)):
        return graph.call_function(kind, (), dict(zip(spec.context, children, strict=True)))
    raise PlanError(
        f"the model returns a {kind.__module__}.{kind.__qualname__}, which a stage's code cannot "
        "rebuild; return a tensor, a tuple, a dict, a dataclass or a transformers ModelOutput"
    )


def _is_namedtuple(kind: type) -> bool:
    return issubclass(kind, tuple) and hasattr(kind, "_fields")


def _keyed(kind: type) -> bool:
    """A class built from keyword fields: a dataclass, or a transformers ``ModelOutput`` (an
    OrderedDict dataclass whose pytree context is its set fields' names)."""
    return dataclasses.is_dataclass(kind)
