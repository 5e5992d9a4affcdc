"""Which split layers the traced code can really run split: a dry run at each degree, before any rank.

A tensor-parallel rank runs the package's traced code with its local shards (a column-wise weight's
output features and bias divided by ``t``, a row-wise weight's input features). That works where
the code reshapes the projections with ``-1`` heads; code that carries a head count as a constant
(Gemma2's eager attention: ``repeat_kv`` expands and reshapes to the whole model's key-value and
query heads) breaks on the local shards: a size mismatch on every rank at the first step.

:func:`checked` finds those layers before planning: the graph is dry-run on fake tensors (torch's
``FakeTensorMode``, as :mod:`partitioner.generation.dry_run`'s last resort: shapes only, no
values) with the planned weights
replaced by stand-ins of their local shapes at each degree ``d`` dividing the greatest common
divisor of the layers' ``tp_max`` (the only degrees a plan takes: one ``t`` divides every split
layer; a layer left out widens it); when a degree fails with all layers split, each layer is tried
alone at it. A layer that fails at a
degree keeps the largest ``tp_max`` whose every degree ran; one that fails at its smallest is kept
whole (replicated inside the tensor group, left out of the plan) and named with the error. The
profile's ``tp_*`` fields and the package's ``tensor_plan.json`` both come from the checked layers,
so the price and the run agree.

A dry run checks shapes, not values: a split whose shapes fit but whose values are wrong (a
constant head count that happens to broadcast) is not caught here; the o-projection's input
features catch the Hugging Face ones tried (docs/layout-3d.md).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import fx, nn

from partitioner.profiler.tensor_plan import TensorLayer, derive

__all__ = ["WHOLE_KEY", "checked", "derive_checked"]

WHOLE_KEY = "tensor_parallel_whole"
"""``Profile.extra`` key: {layer: why} of the layers a dry run keeps whole (``partition`` names them)."""


def _local_shape(p: torch.Tensor, style: str, d: int) -> tuple[int, ...] | None:
    """The shape of a rank's shard of ``p`` at degree ``d`` as the traced code sees it (None:
    whole: a row-wise bias, and a gathered or input-slicing linear, whose output the code sees whole)."""
    if style in ("colwise_gather", "rowwise_split") or (style == "rowwise" and p.dim() != 2):
        return None
    dim = 1 if style == "rowwise" else 0
    shape = list(p.shape)
    shape[dim] //= d
    return tuple(shape)


@contextlib.contextmanager
def _faked(gm: fx.GraphModule, shards: Mapping[str, tuple[str, int]], mode: Any) -> Iterator[None]:
    """Within the block every parameter, buffer and tensor attribute of ``gm`` is a fake tensor
    (of the CPU for a meta one), a planned parameter of its shard's shape; put back afterwards."""
    swapped: list[tuple[Any, str, Any, bool]] = []
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, name: str) -> torch.Tensor:
        key = id(t) if name not in shards else -len(made) - 1
        if key not in made:
            shape = _local_shape(t, *shards[name]) if name in shards else None
            device = torch.device("cpu") if t.device.type == "meta" else t.device
            with mode:
                new = torch.empty(shape or t.shape, dtype=t.dtype, device=device)
            made[key] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[key]

    try:
        for path, module in gm.named_modules():
            for store in (module._parameters, module._buffers):
                for leaf, t in store.items():
                    if t is not None:
                        swapped.append((store, leaf, t, True))
                        store[leaf] = fake(t, f"{path}.{leaf}" if path else leaf)
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            owner_path, _, leaf = str(node.target).rpartition(".")
            owner = gm.get_submodule(owner_path)
            value = getattr(owner, leaf, None)
            if (
                isinstance(value, torch.Tensor)
                and leaf not in owner._parameters
                and leaf not in owner._buffers
            ):
                swapped.append((owner, leaf, value, False))
                object.__setattr__(owner, leaf, fake(value, str(node.target)))
        yield
    finally:
        for holder, leaf, original, stored in reversed(swapped):
            if stored:
                holder[leaf] = original
            else:
                object.__setattr__(holder, leaf, original)


def _error(gm: fx.GraphModule, inputs: Sequence[Any], layers: Sequence[TensorLayer], d: int) -> str | None:
    """Why the graph cannot run with ``layers`` split ``d`` ways on fake tensors (None: it runs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    shards = {n: (style, d) for lay in layers for n, style in lay.params.items()}
    with _faked(gm, shards, mode):
        faked = []
        for t in inputs:
            if isinstance(t, torch.Tensor):
                with mode:
                    where = "cpu" if t.device.type == "meta" else t.device
                    t = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=where)
            faked.append(t)
        try:
            with mode, torch.no_grad():
                fx.Interpreter(gm).run(*faked)
        except Exception as exc:  # (any failure of the split graph is what is asked)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return f"{type(exc).__name__}: {first}"
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def checked(
    gm: fx.GraphModule | None, inputs: Sequence[Any], layers: Sequence[TensorLayer]
) -> tuple[tuple[TensorLayer, ...], dict[str, str]]:
    """(``layers`` with each ``tp_max`` lowered to the degrees its split code runs at, those
    running at none left out; {layer left out: the error of its split at its smallest degree}).

    Nothing is checked without a graph (an estimated profile: its layers are kept as planned).
    """
    if gm is None or not layers:
        return tuple(layers), {}
    if _error(gm, inputs, [], 1) is not None:  # (the whole graph does not dry-run: nothing to tell)
        return tuple(layers), {}
    failed: dict[str, tuple[int, str]] = {}  # layer -> (smallest degree its split breaks at, why)
    tried: set[int] = set()
    while True:  # (the degrees a plan can take: one t divides every split layer's tp_max)
        at = [lay for lay in layers if lay.name not in failed]
        todo = [d for d in _divisors(math.gcd(*(lay.tp_max for lay in at))) if d not in tried] if at else []
        if not todo:
            break
        d = todo[0]
        tried.add(d)
        if _error(gm, inputs, at, d) is None:
            continue
        alone = {lay.name: _error(gm, inputs, [lay], d) for lay in at}
        if all(why is None for why in alone.values()):  # (only together: keep none of them split)
            alone = {name: _error(gm, inputs, at, d) for name in alone}
        failed |= {name: (d, why) for name, why in alone.items() if why is not None}
    return _lowered(layers, failed)


def _lowered(
    layers: Sequence[TensorLayer], failed: Mapping[str, tuple[int, str]]
) -> tuple[tuple[TensorLayer, ...], dict[str, str]]:
    """Each failed layer's ``tp_max`` as the largest divisor whose degrees all stay below the one it
    broke at; the layers left with 1, by name with their error."""
    kept, whole = [], {}
    for lay in layers:
        if lay.name not in failed:
            kept.append(lay)
            continue
        broke, why = failed[lay.name]
        ok = [m for m in (1, *_divisors(lay.tp_max)) if all(d < broke for d in _divisors(m))]
        top = max(ok)
        if top == 1:
            whole[lay.name] = f"at degree {broke}: {why}"
        else:
            kept.append(replace(lay, tp_max=top))
    return tuple(kept), whole


def derive_checked(
    gm: fx.GraphModule | None, model: nn.Module, inputs: Sequence[Any]
) -> tuple[tuple[TensorLayer, ...], dict[str, str]]:
    """:func:`~partitioner.profiler.tensor_plan.derive`'s layers, :func:`checked` on ``gm`` where
    they come from the model's own ``base_model_tp_plan``. A plan found in the graph is not checked:
    its linears are joined by elementwise operations only, which carry no head counts (an
    elementwise weight of the whole width would still break it, uncaught), and checking vgg16's
    classifier at the 12 degrees dividing 4096 cost 7 s of ``profile`` on this 2-core machine."""
    layers = derive(gm, model)
    config = getattr(model, "config", None)
    return checked(gm, inputs, layers) if getattr(config, "base_model_tp_plan", None) else (layers, {})
