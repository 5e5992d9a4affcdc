"""Which layers tensor parallelism splits, and how (docs/layout-3d.md): a pure function of the model
and its traced graph, written into a 3D package as ``tensor_plan.json`` for the runtime
(:mod:`runtime.executing.tensor_parallel`) and summarised per profile node for the planner
(:func:`annotate`: ``tp_param_bytes``, ``tp_comm_bytes``, ``tp_max``).

- A Hugging Face model whose config ships ``base_model_tp_plan`` is split as that plan says, for its
  ``colwise``, ``rowwise``, ``colwise_gather_output`` and ``rowwise_split_input`` entries on linear
  layers (others, such as Mixtral's packed experts, stay whole); an attention block split by heads
  (plain ``colwise`` projections) must have a degree dividing its query and key-value heads.
- Any other model: Megatron's pattern found in the traced graph. A linear layer whose input is
  computed from one or more linear layers of one shared input through elementwise operations only
  (an MLP's ``fc1 -> act -> fc2``, a gated ``down(act(gate(x)) * up(x))``), every intermediate read
  by nothing else, is split row-wise, those feeding it column-wise. Attention outside Hugging
  Face's plans is not recognised and stays whole.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn

from partitioner.graph import Node

__all__ = [
    "HF_STYLES", "SCHEMA", "UNKNOWN_KEY", "TensorLayer", "annotate", "derive", "profiled", "to_json",
    "tokens_of", "unknown_styles",
]  # fmt: skip

SCHEMA = "pipeplan.tensor_plan/1"

UNKNOWN_KEY = "tensor_parallel_unknown_styles"
"""``Profile.extra`` key: {pattern: style} of the model's ``base_model_tp_plan`` entries not split
(styles other than ``colwise`` and ``rowwise``: the layers stay whole; ``partition`` names them)."""

_ELEMENTWISE = {
    "relu", "gelu", "silu", "tanh", "sigmoid", "mul", "add", "sub", "dropout", "clone", "to", "neg",
    "leaky_relu", "elu", "softplus", "mish", "hardtanh", "hardswish", "hardsigmoid", "square", "pow",
    "relu_", "gelu_", "silu_", "dropout_", "contiguous", "type_as",
}  # fmt: skip


@dataclass(frozen=True)
class TensorLayer:
    """One split layer: an attention block or an MLP.

    Attributes:
        name: its module path (``model.layers.0.self_attn``).
        tp_max: the largest degree it divides into; a degree must divide it.
        params: parameter name -> ``colwise`` (split on dim 0, weights and biases), ``rowwise`` (a
            weight split on dim 1), ``colwise_gather`` (as ``colwise``, the output all-gathered) or
            ``rowwise_split`` (as ``rowwise``, taking its slice of a whole input).
        rowwise_out: features per token its forward all-reduces: its row-wise linears' outputs, and
            half of each gathered column-wise output (an all-gather moves half the bytes).
    """

    name: str
    tp_max: int
    params: Mapping[str, str]
    rowwise_out: tuple[int, ...] = ()


def derive(gm: fx.GraphModule | None, model: nn.Module) -> tuple[TensorLayer, ...]:
    """The model's split layers: its own Hugging Face plan where it has one, else the graph's."""
    config = getattr(model, "config", None)
    hf_plan = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if hf_plan:
        return _from_hf(model, dict(hf_plan), config)
    return _from_graph(gm, model) if gm is not None else ()


HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",
    "rowwise_split_input": "rowwise_split",
}
"""Hugging Face's plan styles split here -> the tensor plan's (``*_gather``: the output all-gathered
whole; ``*_split``: a whole input sliced, the partial output all-reduced)."""


def unknown_styles(model: nn.Module) -> dict[str, str]:
    """The entries of the model's ``base_model_tp_plan`` this plan does not split, by pattern
    (Mixtral's ``packed_colwise`` experts, ``moe_tp_experts``)."""
    config = getattr(model, "config", None)
    hf_plan = getattr(config, "base_model_tp_plan", None) or {}
    return {str(k): str(v) for k, v in dict(hf_plan).items() if v not in HF_STYLES}


def _linear_modules(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _layer(name: str, modules: Mapping[str, tuple[nn.Linear, str]], heads: Sequence[int]) -> TensorLayer:
    params: dict[str, str] = {}
    sizes = list(heads)
    rowwise = []
    for path, (mod, style) in modules.items():
        column = style.startswith("colwise")
        params[f"{path}.weight"] = style
        if mod.bias is not None and column:
            params[f"{path}.bias"] = style
        sizes.append(mod.out_features if column else mod.in_features)
        if not column:
            rowwise.append(mod.out_features)
        elif style == "colwise_gather":  # (an all-gather moves half an all-reduce's bytes)
            rowwise.append(mod.out_features // 2)
    return TensorLayer(name, math.gcd(*sizes), params, tuple(rowwise))


def _from_hf(model: nn.Module, plan: Mapping[str, str], config: Any) -> tuple[TensorLayer, ...]:
    prefix = getattr(model, "base_model_prefix", "") or ""
    linears = _linear_modules(model)
    found: dict[str, dict[str, tuple[nn.Linear, str]]] = {}
    for pattern, hf_style in plan.items():
        if hf_style not in HF_STYLES:
            continue
        style = HF_STYLES[hf_style]
        rx = re.compile(
            "^" + re.escape(f"{prefix}.{pattern}" if prefix else pattern).replace(r"\*", r"\d+") + "$"
        )
        for path, mod in linears.items():
            if rx.match(path):
                found.setdefault(path.rpartition(".")[0], {})[path] = (mod, style)
    heads = [
        getattr(config, k) for k in ("num_attention_heads", "num_key_value_heads") if getattr(config, k, None)
    ]
    layers = []
    for name, modules in found.items():
        styles = {s for _, s in modules.values()}
        if ("colwise" in styles) != ("rowwise" in styles):  # (half a pair: a partial sum unreduced)
            continue
        attention = "attn" in name.rsplit(".", 1)[-1] or "attention" in name
        by_heads = attention and "colwise" in styles  # (gathered projections leave attention whole)
        layers.append(_layer(name, modules, heads if by_heads else ()))
    return tuple(layers)


def _op_name(node: fx.Node, gm: fx.GraphModule) -> str:
    """A node's operation without namespace or overload (``aten.relu.default`` -> ``relu``)."""
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__.lower()
    if node.op in ("call_function", "call_method"):
        target = node.target
        name = getattr(target, "__name__", str(target))
        if hasattr(target, "_schema"):
            name = target._schema.name.split("::")[-1]
        return name.split(".")[0]
    return node.op


def _linear_of(node: fx.Node, gm: fx.GraphModule) -> tuple[str, fx.Node] | None:
    """(module path, input node) of a linear layer's call, or None."""
    if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.Linear):
        return str(node.target), node.args[0]  # type: ignore[return-value]
    if node.op == "call_function" and _op_name(node, gm) == "linear" and len(node.args) >= 2:
        weight = node.args[1]
        if isinstance(weight, fx.Node) and weight.op == "get_attr" and str(weight.target).endswith(".weight"):
            return str(weight.target).removesuffix(".weight"), node.args[0]  # type: ignore[return-value]
    return None


def _feeders(
    start: fx.Node, gm: fx.GraphModule, linears: Mapping[fx.Node, tuple[str, fx.Node]]
) -> list[fx.Node] | None:
    """The linear nodes ``start`` is computed from through elementwise nodes read by nothing else,
    or None when anything else feeds it."""
    found, chain, stack = [], set(), [start]
    while stack:
        node = stack.pop()
        if node in linears:
            found.append(node)
            continue
        if _op_name(node, gm) not in _ELEMENTWISE:
            return None
        chain.add(node)
        stack += [a for a in node.all_input_nodes if a.op != "get_attr"]
    inner = chain | set(found)
    if any(u not in inner for n in chain - {start} for u in n.users):
        return None
    return found or None


def _from_graph(gm: fx.GraphModule, model: nn.Module) -> tuple[TensorLayer, ...]:
    modules = _linear_modules(model)
    linears = {n: lin for n in gm.graph.nodes if (lin := _linear_of(n, gm)) and lin[0] in modules}
    taken: set[str] = set()
    layers = []
    for path, source in linears.values():
        feeders = _feeders(source, gm, linears) if isinstance(source, fx.Node) else None
        if not feeders or path in taken:
            continue
        cols = [linears[f][0] for f in feeders]
        inputs = {linears[f][1] for f in feeders}
        if len(inputs) != 1 or taken & set(cols) or any(len(f.users) != 1 for f in feeders):
            continue
        taken |= {path, *cols}
        group = {c: (modules[c], "colwise") for c in cols} | {path: (modules[path], "rowwise")}
        name = _common_prefix([path, *cols])
        layers.append(_layer(name, group, ()))
    return tuple(layers)


def _common_prefix(paths: Iterable[str]) -> str:
    parts = [p.split(".") for p in paths]
    common = []
    for pieces in zip(*parts, strict=False):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    return ".".join(common) or "+".join(sorted(paths))


def to_json(layers: Sequence[TensorLayer]) -> dict[str, Any]:
    """``tensor_plan.json`` (read by :func:`runtime.executing.tensor_parallel.read_plan`)."""
    return {
        "schema": SCHEMA,
        "layers": [{"name": lay.name, "tp_max": lay.tp_max, "params": dict(lay.params)} for lay in layers],
    }


def annotate(
    nodes: Sequence[Node],
    layers: Sequence[TensorLayer],
    shapes: Mapping[str, tuple[int, int]],
    tokens: int,
    elem_bytes: int,
) -> tuple[Node, ...]:
    """Profile nodes with the planner's fields filled where they hold split parameters: the bytes
    split (``tp_param_bytes``; ``shapes``: per parameter name, its bytes and output features), the
    row-wise layers' forward all-reduce per minibatch of ``tokens`` rows of ``elem_bytes``
    activations (``tp_comm_bytes``) and the degrees allowed (``tp_max``)."""
    styles = {p: (lay, style) for lay in layers for p, style in lay.params.items()}
    out = []
    for node in nodes:
        held = [(p, *styles[p]) for p in node.param_names if p in styles]
        if not held:
            out.append(node)
            continue
        split = sum(shapes[p][0] for p, _, _ in held if p in shapes)
        rows = [shapes[p][1] for p, _, style in held if style.startswith("rowwise") and p in shapes]
        rows += [  # (an all-gather of a gathered output: half an all-reduce's bytes)
            shapes[p][1] // 2
            for p, _, s in held
            if s == "colwise_gather" and p in shapes and p.endswith("weight")
        ]
        tp_max = math.gcd(*(lay.tp_max for _, lay, _ in held))
        comm = sum(tokens * f * elem_bytes for f in rows)
        out.append(replace(node, tp_param_bytes=split, tp_comm_bytes=comm, tp_max=tp_max))
    return tuple(out)


def profiled(
    nodes: Sequence[Node],
    gm: fx.GraphModule | None,
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    precision: str,
    layers: Sequence[TensorLayer] | None = None,
) -> tuple[Node, ...]:
    """:func:`annotate` for a traced, measured profile: ``layers`` (default: the plan :func:`derive`
    finds), the model's parameter sizes, the rows of its first input."""
    layers = derive(gm, model) if layers is None else layers
    if not layers:
        return tuple(nodes)
    shapes = {
        n: (p.numel() * p.element_size(), int(p.shape[0]))
        for n, p in model.named_parameters(remove_duplicate=False)
    }
    return annotate(nodes, layers, shapes, tokens_of(inputs), 4 if precision == "fp32" else 2)


def tokens_of(inputs: Sequence[torch.Tensor]) -> int:
    """Rows a linear layer sees per minibatch: the first input's elements (ids: batch x sequence),
    or its batch for a float input."""
    first = inputs[0]
    return int(first.numel()) if not first.is_floating_point() else int(first.shape[0])
