"""Tensor parallelism inside a stage: Megatron's column- and row-wise linear layers on DTensor weights.

A package's stages are torch.fx's own code: flat calls of ``aten.linear`` on weights read from the
stage's attributes, with no ``nn.Linear`` whose forward DTensor's ``parallelize_module`` could wrap.
So the split is made where the stage's code meets it:

- each weight the package's tensor plan names (``tensor_plan.json``, written by the code generator
  from the model's own ``base_model_tp_plan`` or the traced graph) becomes a DTensor on the copy's
  tensor mesh, ``Shard(0)`` (column-wise: output features, and its bias) or ``Shard(1)`` (row-wise:
  input features; its bias stays whole), so the stage's state dict, DCP and FSDP2 see DTensors;
- while the stage runs, a ``TorchFunctionMode`` catches every linear whose weight is such a
  DTensor and runs it on the local shard, with Megatron's two operators around it: a column-wise
  layer's input is whole and its gradient is all-reduced over the tensor group (``f``), a row-wise
  layer's partial output is all-reduced in the forward and its gradient passed through (``g``), its
  bias added once after the sum;
- Hugging Face's ``colwise_gather_output`` (a column-wise layer whose local output is all-gathered
  whole, the gradient's own slice taken back) and ``rowwise_split_input`` (a row-wise layer taking
  its slice of a whole input, the slices' gradients all-gathered) leave the code between them
  whole: Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` split without splitting the heads.

Everything else (norms, embeddings, the loss, layers the plan leaves out) is computed whole by every
tensor rank, on identical inputs, and so gets identical gradients there. Attention splits by heads
without knowing it where the traced code reshapes projections with ``-1`` heads: each rank's local
query, key and value columns are then whole heads when ``t`` divides the head counts (checked).
Code that carries a head count as a constant (Gemma2's ``repeat_kv``) would break on the shards; the
plan leaves such layers out (:mod:`partitioner.profiler.tensor_check`), so they run whole here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from runtime.errors import RunError

__all__ = ["PLAN_FILE", "TensorPlan", "check_degrees", "planned_splits", "read_plan", "split_stage"]

PLAN_FILE = "tensor_plan.json"
SCHEMA = "pipeplan.tensor_plan/1"
STYLES = ("colwise", "rowwise", "colwise_gather", "rowwise_split")


@dataclass(frozen=True)
class TensorPlan:
    """A package's tensor plan.

    Attributes:
        layers: (layer name, largest degree it divides into, {parameter name: style}) per split
            layer; styles are ``colwise`` (a weight or bias split on dim 0), ``rowwise`` (a weight
            split on dim 1), and ``colwise_gather`` / ``rowwise_split`` (split so, the output
            gathered / the input sliced).
    """

    layers: tuple[tuple[str, int, Mapping[str, str]], ...]


def read_plan(package: Path) -> TensorPlan:
    """The package's tensor plan (empty when it has none: every layer then stays whole).

    Raises:
        RunError: a file of another format.
    """
    path = Path(package) / PLAN_FILE
    if not path.exists():
        return TensorPlan(())
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        assert doc["schema"] == SCHEMA
        layers = tuple(
            (str(lay["name"]), int(lay["tp_max"]), {str(k): str(v) for k, v in lay["params"].items()})
            for lay in doc["layers"]
        )
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as exc:
        raise RunError(f"{path} is not a pipeplan tensor plan ({exc}); regenerate the package") from None
    for _, _, params in layers:
        bad = sorted(set(params.values()) - set(STYLES))
        if bad:
            raise RunError(f"{path}: unknown split styles {bad}; regenerate the package")
    return TensorPlan(layers)


class _CopyToTensor(torch.autograd.Function):
    """Megatron's ``f``: identity forward, gradient all-reduced over the tensor group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensor(torch.autograd.Function):
    """Megatron's ``g``: partial sums all-reduced forward, gradient passed through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTensor(torch.autograd.Function):
    """A column-wise output all-gathered whole on the last dim; the gradient's own slice back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        t, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(t, dim=-1)[rank].contiguous(), None


class _SliceForTensor(torch.autograd.Function):
    """A whole input's own slice on the last dim; the slices' gradients all-gathered whole."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        t, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(t, dim=-1)[rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad, group=ctx.group)
        return torch.cat(parts, dim=-1), None


_LINEARS = (torch.ops.aten.linear.default, torch.nn.functional.linear)


class _SplitLinears(TorchFunctionMode):
    """Runs linears on DTensor weights as their local shards, with ``f`` and ``g`` around them."""

    def __init__(self, group: dist.ProcessGroup, gathered: set[int], sliced: set[int]) -> None:
        super().__init__()
        self.group = group
        self.gathered, self.sliced = gathered, sliced  # ids of the weights of those styles
        self.copied: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # input -> (input, its f)

    def _copy(self, x: torch.Tensor) -> torch.Tensor:
        """``f`` of ``x``, once per tensor: attention's query, key and value projections (an MLP's
        gate and up) read one input, whose gradient is then all-reduced once, as Megatron does."""
        if id(x) not in self.copied:  # (the entry keeps x alive: its id is not reused meanwhile)
            self.copied[id(x)] = (x, _CopyToTensor.apply(x, self.group))  # type: ignore[no-untyped-call]
        return self.copied[id(x)][1]

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor, Shard

        kwargs = kwargs or {}
        if func in _LINEARS and len(args) >= 2 and isinstance(args[1], DTensor):
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            (placement,) = w.placements
            if placement == Shard(0):
                bias = b.to_local() if isinstance(b, DTensor) else b
                out = torch.nn.functional.linear(self._copy(x), w.to_local(), bias)
                gather = id(w) in self.gathered
                return _GatherFromTensor.apply(out, self.group) if gather else out  # type: ignore[no-untyped-call]
            if placement == Shard(1):
                if id(w) in self.sliced:
                    x = _SliceForTensor.apply(x, self.group)  # type: ignore[no-untyped-call]
                part = torch.nn.functional.linear(x, w.to_local())
                out = _ReduceFromTensor.apply(part, self.group)  # type: ignore[no-untyped-call]
                return out if b is None else out + b
        return func(*args, **kwargs)


def _split_forward(
    forward: Any,
    group: dist.ProcessGroup,
    module: nn.Module,
    styled: Mapping[str, str],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``forward`` with the split linears; the gathered and sliced weights are looked up by name on
    each call (FSDP2 registers its own unsharded parameters while the stage computes)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    ids = {style: {id(params[n]) for n, s in styled.items() if s == style} for style in STYLES[2:]}
    with _SplitLinears(group, ids["colwise_gather"], ids["rowwise_split"]):
        return forward(*args, **kwargs)


def _layers_of(plan: TensorPlan, names: set[str]) -> list[tuple[str, int, dict[str, str]]]:
    """The plan's layers this stage holds (a layer split between stages is split where it lies)."""
    out = []
    for name, tp_max, params in plan.layers:
        here = {p: s for p, s in params.items() if p in names}
        if here:
            out.append((name, tp_max, here))
    return out


def planned_splits(
    module: nn.Module, plan: TensorPlan, t: int, stage: int
) -> tuple[list[str], list[tuple[str, int]]]:
    """The layers of ``plan`` that ``module`` holds, and (parameter, dim) of every split it makes at
    degree ``t``; works on the meta device (the launcher checks a package before any rank starts).

    Raises:
        RunError: a degree that does not divide a layer's heads or features, naming both.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    counts: dict[int, int] = {}
    for p in params.values():
        counts[id(p)] = counts.get(id(p), 0) + 1
    layers, splits = [], []
    for layer, tp_max, styles in _layers_of(plan, set(params)):
        if tp_max % t:
            raise RunError(
                f"stage {stage}: tensor_parallel {t} does not divide layer {layer} (its heads and "
                f"features allow degrees dividing {tp_max})"
            )
        for name, style in styles.items():
            p = params[name]
            row = style.startswith("rowwise")
            if row and p.dim() != 2:  # (a row-wise layer's bias is added whole)
                continue
            dim = 1 if row else 0
            if counts[id(p)] > 1 or p.shape[dim] % t:
                why = "it is tied" if counts[id(p)] > 1 else f"{p.shape[dim]} is not a multiple of {t}"
                raise RunError(
                    f"stage {stage}: {name} {list(p.shape)} cannot be split {t} ways on dim {dim} ({why})"
                )
            splits.append((name, dim))
        layers.append(layer)
    return layers, splits


def split_stage(
    module: nn.Module, plan: TensorPlan, mesh: Any, group: dist.ProcessGroup, tensor_rank: int, stage: int
) -> list[str]:
    """Split ``module``'s planned weights over the tensor mesh (``mesh``, 1D) in place and make its
    forward run them split; returns the layers split.

    Raises:
        RunError: as :func:`planned_splits`.
    """
    from torch.distributed.tensor import DTensor, Shard

    t = mesh.size()
    layers, splits = planned_splits(module, plan, t, stage)
    styled = {n: s for _, _, styles in _layers_of(plan, {n for n, _ in splits}) for n, s in styles.items()}
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, dim in splits:
        p = params[name]
        shard = p.detach().chunk(t, dim)[tensor_rank].clone()
        dt = DTensor.from_local(shard, mesh, [Shard(dim)], run_check=False, shape=p.shape, stride=p.stride())
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner), leaf, nn.Parameter(dt, requires_grad=p.requires_grad))
    if layers:
        module.forward = functools.partial(_split_forward, module.forward, group, module, styled)
    return layers


def check_degrees(package: Any, wiring: Any, job: Any) -> None:
    """Every tensor-parallel stage's splits, checked on the meta device before any rank starts.

    Raises:
        RunError: as :func:`planned_splits`.
    """
    from runtime.packages.load import build_stage

    plan = read_plan(job.package)
    for k in range(job.stages):
        t = job.layout(k).tensor_parallel
        if t > 1:
            module = build_stage(package, wiring, k, job.module_stages, 0, torch.device("meta"))
            planned_splits(module, plan, t, k)
