"""What the 3D planner needs of a decoder layer (docs/layout-3d.md's node fields), from its shapes.

A Llama-style decoder layer (Llama, Mistral, Qwen2 and their kin: ``q_proj``, ``k_proj``,
``v_proj``, ``o_proj`` and ``gate_proj``, ``up_proj``, ``down_proj``) splits as Megatron splits it:
the query, key, value, gate and up projections column-wise, the output and down projections
row-wise, attention by heads. Its ``tp_param_bytes`` are those projections' (biases of the
column-wise ones too), its ``tp_comm_bytes`` the two row-wise outputs (each the layer's output
size), its ``tp_max`` the greatest common divisor of the query heads, the key-value heads and the
intermediate size. The FLOPs of each split product for one sample go to
``profile.extra[PRODUCTS_KEY]``, so the planner prices the smaller products on the device model's
curve. Layers of other shapes keep no fields: tensor parallelism leaves them whole.
"""

from __future__ import annotations

import math
from dataclasses import replace

from torch import nn

from partitioner.graph import Node, Profile
from partitioner.optimizer.pricing.tensor import PRODUCTS_KEY, TOKENS_KEY

__all__ = ["with_tensor_fields"]

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def _heads(module: nn.Module) -> tuple[int, int, int] | None:
    config = getattr(module, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    return int(heads), int(kv), int(getattr(config, "intermediate_size", 0) or 0)


def _split(node: Node, params: dict[str, nn.Parameter], heads: tuple[int, int, int]) -> Node:
    """``node`` with its fields, if it is a decoder layer of the shape above."""
    names = {name.rsplit(".", 2)[-2]: name for name in node.param_names if name.endswith(".weight")}
    if not all(k in names for k in (*_COLUMN, *_ROW)):
        return node
    split = [p for p in node.param_names if p.rsplit(".", 2)[-2] in (*_COLUMN, *_ROW)]
    tp_bytes = sum(params[p].numel() * params[p].element_size() for p in split if p in params)
    return replace(
        node,
        tp_param_bytes=min(int(tp_bytes), node.param_bytes),
        tp_comm_bytes=2 * node.output_bytes,
        tp_max=math.gcd(*heads),
    )


def _tokens(node: Node, params: dict[str, nn.Parameter], batch: int) -> float:
    """Tokens of one sample: the layer's output is one hidden vector per token."""
    names = {name.rsplit(".", 2)[-2]: name for name in node.param_names if name.endswith(".weight")}
    out = params[names["o_proj"]]
    return node.output_bytes / max(batch * out.shape[0] * out.element_size(), 1)


def _products(node: Node, params: dict[str, nn.Parameter], batch: int) -> list[float]:
    """FLOPs of each split product of one sample: the projections and the (causal) attention."""
    names = {name.rsplit(".", 2)[-2]: name for name in node.param_names if name.endswith(".weight")}
    hidden = params[names["o_proj"]].shape[0]
    tokens = _tokens(node, params, batch)
    flops = [2.0 * tokens * params[names[k]].numel() for k in (*_COLUMN, *_ROW)]
    return [*flops, 2.0 * tokens * tokens * hidden]  # (QK^T and AV, causal: half of 4 t^2 h)


def with_tensor_fields(profile: Profile, module: nn.Module) -> Profile:
    """``profile`` with docs/layout-3d.md's node fields on its decoder layers (module docstring)."""
    heads = _heads(module)
    batch = profile.batch_size or 1
    if heads is None:
        return profile
    params = dict(module.named_parameters(remove_duplicate=False))
    nodes, products, tokens = [], {}, 0.0
    for node in profile.nodes:
        done = _split(node, params, heads) if node.param_names else node
        if done.tp_max:
            products[node.id] = _products(node, params, batch)
            tokens = _tokens(node, params, batch)
        nodes.append(done)
    if not products:
        return profile
    extra = {**dict(profile.extra), PRODUCTS_KEY: products, TOKENS_KEY: tokens}
    return replace(profile, nodes=tuple(nodes), extra=extra)
