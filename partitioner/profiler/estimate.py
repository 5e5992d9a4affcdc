"""Estimate each layer's time on a device that is not here, from the work torch counts on meta tensors.

Every layer runs forward and backward on the meta device, as :class:`LayerProfiler` would run it on
a real one, while a dispatch mode watches each aten operation: its floating-point operations (from
torch's own ``torch.utils.flop_counter`` formulas) and the bytes it reads and writes. Each kernel is
priced on a roofline of the :class:`~partitioner.hardware.devices.DeviceModel`,

    seconds = max(flops / matmul_rate(dtype, flops),
                  bytes / (bandwidth * memory_efficiency),
                  launch_s),

where ``matmul_rate`` follows the device's measured curve of matrix-product rate against size (a
small product reaches a fraction of the peak), or its peak times ``matmul_efficiency``,

and a layer's time is the sum over its kernels (a GPU runs one stream of them; launches overlap
the kernels before them, so a kernel costs at least a launch). Views, detaches and shape queries
launch nothing and cost nothing. Attention (``scaled_dot_product_attention``) is priced as the fused
kernel a GPU runs (flash or memory-efficient attention: the score matrix never reaches memory), not
as the matrix products meta tensors decompose it into. Each layer's fixed time per call is its
kernels' launches. Saved-for-backward and output bytes are counted as the profiler counts them.

What this cannot see: kernel choice and fusion beyond attention (torch.compile), caching effects,
communication (the cost model prices it), and data-dependent work: a mixture-of-experts layer
is estimated as its meta run does it (see :func:`moe_assumption`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from partitioner.hardware.devices import DeviceModel
from partitioner.profiler.measure import LayerCost, LayerProfiler, _tensors
from partitioner.profiler.meta_autocast import autocast_on
from partitioner.profiler.trace import Group
from partitioner.profiler.update_timing import _OPTIMIZERS, _sample
from partitioner.profiler.working import backward_working, split_deferred

__all__ = ["LayerEstimator", "Work", "estimate_loss", "estimate_update", "moe_assumption", "on_meta"]

_aten = torch.ops.aten
_FREE = {
    _aten.detach.default, _aten.alias.default, _aten._unsafe_view.default, _aten.lift_fresh.default,
    _aten.lift_fresh_copy.default, _aten.empty.memory_format, _aten.empty_like.default,
    _aten.empty_strided.default, _aten.new_empty.default, _aten.new_empty_strided.default,
    _aten._assert_tensor_metadata.default, _aten.sym_size.int, _aten.sym_numel.default,
    _aten.sym_stride.int, _aten.sym_storage_offset.default, _aten.scalar_tensor.default,
}  # fmt: skip
_CONVOLUTIONS = {"convolution", "_convolution", "convolution_backward", "cudnn_convolution"}
_SDPA = {torch.nn.functional.scaled_dot_product_attention, _aten.scaled_dot_product_attention.default}


@dataclass
class Work:
    """What a run of kernels costs on a device model: seconds, and what they were made of."""

    seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    kernels: int = 0

    def add(self, model: DeviceModel, flops: float, nbytes: float, dtype: str) -> None:
        """One kernel: the longest of its compute, its memory traffic and a launch."""
        math_s = flops / model.matmul_rate(dtype, flops) if flops else 0.0
        memory_s = nbytes / (model.memory_bandwidth * model.memory_efficiency)
        self.seconds += max(math_s, memory_s, model.launch_s)
        self.flops += flops
        self.bytes += nbytes
        self.kernels += 1


@dataclass
class _Sink:
    """Where kernels are counted now (the forward's or the backward's :class:`Work`)."""

    model: DeviceModel
    work: Work = field(default_factory=Work)


def _nbytes(t: Tensor) -> int:
    """Bytes a kernel moves for ``t``: its elements, at most its storage (a broadcast reads less)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def _compute_dtype(sink: _Sink, name: str, tensors: Sequence[Tensor]) -> str:
    """The dtype a kernel computes in: its inputs' (under ``--precision`` autocast the layers ran
    in :class:`~partitioner.profiler.meta_autocast.MetaAutocast`, so a matrix product's inputs are
    already low-precision); a float32 matrix product in the device's float32 matmul type (TF32)."""
    floats = [t.dtype for t in tensors if t.is_floating_point()]
    dtype = str(floats[0]).removeprefix("torch.") if floats else "float32"
    if dtype == "float32":
        return sink.model.float32_conv if name in _CONVOLUTIONS else sink.model.float32_matmul
    return dtype


class _Counter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Prices every aten kernel that runs inside it into ``sink.work``."""

    def __init__(self, sink: _Sink) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sink = sink
        self.formulas = FlopCounterMode(display=False).flop_registry

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FREE or getattr(func, "is_view", False):
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        unique = {id(t): t for t in inputs + outputs}
        packet = func._overloadpacket
        if packet in self.formulas:
            flops = float(self.formulas[packet](*args, **kwargs, out_val=out))
        else:
            flops = _grouped_flops(str(packet), inputs)
        dtype = _compute_dtype(self.sink, packet.__name__, inputs) if flops else "float32"
        self.sink.work.add(self.sink.model, flops, sum(_nbytes(t) for t in unique.values()), dtype)
        return out


def _grouped_flops(name: str, inputs: Sequence[Tensor]) -> float:
    """FLOPs of a grouped matrix product (``aten._grouped_mm``, transformers' ``grouped_mm_fallback``:
    the experts of a mixture of experts, tokens (S, K) sorted by expert against weights (E, K, N)),
    which torch's flop counter does not know: 2 S K N forward, twice that backward, however the
    tokens are shared among the experts. Priced as one product of that size: balanced experts."""
    if "grouped_mm" not in name or len(inputs) < 2 or inputs[0].dim() != 2 or inputs[1].dim() != 3:
        return 0.0
    tokens, width = inputs[0].shape
    weight = inputs[1].shape
    out = weight[2] if weight[1] == width else weight[1]
    flops = 2.0 * tokens * width * out
    return 2 * flops if "backward" in name else flops


class _FusedAttention(torch.autograd.Function):
    """scaled_dot_product_attention as one fused kernel forward and one backward (flash attention:
    2 matrix products forward, 5 backward; a causal mask halves both)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool, sink: _Sink) -> Tensor:
        heads, length = q.shape[-3], q.shape[-2]
        out = torch.empty(*q.shape[:-3], length, heads, v.shape[-1], dtype=q.dtype, device=q.device)
        out = out.transpose(-2, -3)  # the layout flash attention returns: (..., L, H, D) in memory
        lse = torch.empty(*q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.sink, ctx.flops = sink, _attention_flops(q, k, v, causal)
        nbytes = sum(_nbytes(t) for t in (q, k, v, out, lse))
        sink.work.add(sink.model, ctx.flops, nbytes, _compute_dtype(sink, "attention", [q]))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        q, k, v, out, lse = ctx.saved_tensors
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        nbytes = sum(_nbytes(t) for t in (q, k, v, out, lse, grad, *grads))
        ctx.sink.work.add(ctx.sink.model, 2.5 * ctx.flops, nbytes, _compute_dtype(ctx.sink, "attention", [q]))
        return (*grads, None, None)


def _attention_flops(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> float:
    """2 * q_len * k_len * (d_qk + d_v) per head and batch (the two products QK^T and PV)."""
    heads = q.shape[:-2].numel()
    flops = 2.0 * heads * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    return flops / 2 if causal else flops


class _Attention(TorchFunctionMode):
    """Routes scaled_dot_product_attention to :class:`_FusedAttention`."""

    def __init__(self, sink: _Sink) -> None:
        super().__init__()
        self.sink = sink

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _SDPA:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
        return _FusedAttention.apply(q, k, v, causal, self.sink)  # type: ignore[no-untyped-call]


class LayerEstimator(LayerProfiler):
    """:class:`LayerProfiler` on the meta device, each layer's measurement replaced by an estimate.

    Example:
        >>> costs = LayerEstimator(on_meta(gm), groups, load_device_model("h100")).profile(*meta_inputs)
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        groups: Sequence[Group],
        model: DeviceModel,
        precision: str = "fp32",
        reuse: bool = True,
        progress: Callable[[int, int, str], None] | None = None,
    ) -> None:
        meta = torch.device("meta")
        super().__init__(
            gm, groups, repeats=1, progress=progress, reuse=reuse, precision=precision, device=meta
        )
        self.model = model
        self.kernels: dict[str, tuple[int, int]] = {}
        """group id -> kernels of its forward and backward: its fixed time per call, in launches."""
        self.work: dict[str, tuple[Work, Work]] = {}

    def fixed(self) -> dict[str, tuple[float, float]]:
        """Each group's fixed forward and backward ms per call: one launch per kernel."""
        ms = self.model.launch_s * 1e3
        done = {g: (f * ms, b * ms) for g, (f, b) in self.kernels.items()}
        return {**done, **{g: done[t] for g, t in self.twins.items() if t in done}}

    def _measure(self, group: Group) -> LayerCost:
        members = [self.by_name[m] for m in group.members]
        if members[0].op in ("placeholder", "output"):
            return super()._measure(group)
        external = {a for m in members for a in m.all_input_nodes if a.name not in group.members}
        exported = [m for m in members if any(self.member_of[u.name] != group.id for u in m.users)]
        params = self._params_of(members)
        leaves, env, aliases = self._fresh_inputs(external)
        sink = _Sink(self.model)  # the attention's backward finds it here
        with _Attention(sink), _Counter(sink):
            outs, keys, casts = self._forward(members, env, record_saved=True)
        saved, cast = self._saved_bytes(group.id, members, (keys, aliases, casts), exported, outs)
        forward, sink.work = sink.work, Work()
        differentiable = [t for m in exported for t in _tensors(outs[m.name]) if t.grad_fn is not None]
        working = deferred = 0
        if differentiable and (leaves or params):
            seeds = [torch.ones_like(t) for t in differentiable]
            with torch.enable_grad():
                working = backward_working(differentiable, leaves, seeds)
                deferred = split_deferred(differentiable, leaves, params, seeds)
                sink.work = Work()  # (the fused attention's backward reports its work to the sink)
                with _Counter(sink):
                    torch.autograd.grad(differentiable, [*leaves, *params], seeds, allow_unused=True)
        backward = sink.work
        self.kernels[group.id] = (forward.kernels, backward.kernels)
        self.work[group.id] = (forward, backward)
        out_bytes = sum(t.nbytes for m in exported for t in _tensors(self.env[m]))
        return LayerCost(
            forward.seconds * 1e3, backward.seconds * 1e3, out_bytes, saved, cast, working, deferred,
            self.kept_output(group.id, exported),
        )  # fmt: skip


def estimate_loss(
    output: Any, targets: Tensor, loss_fn: Callable[[Any, Tensor], Tensor], model: DeviceModel, precision: str
) -> tuple[float, float]:
    """(forward_ms, backward_ms) of the loss on the model's (meta) output."""
    leaf = tree_map(
        lambda v: v.detach().requires_grad_() if isinstance(v, Tensor) and v.is_floating_point() else v,
        output,
    )
    sink = _Sink(model)
    with torch.enable_grad():
        with _Counter(sink), autocast_on(precision, torch.device("meta")):
            loss = loss_fn(leaf, targets.to("meta"))
        forward, sink.work = sink.work, Work()
        if loss.grad_fn is not None:
            with _Counter(sink):
                loss.backward()  # type: ignore[no-untyped-call]
    return forward.seconds * 1e3, sink.work.seconds * 1e3


def estimate_update(module: nn.Module, model: DeviceModel) -> dict[str, float]:
    """Seconds per parameter byte of one step of each optimizer, from the kernels torch's own
    optimizers run (one step after the one that makes their state) on meta copies of the first
    parameters."""
    params = [p for p in module.parameters() if p.requires_grad and p.is_floating_point()]
    sample = _sample(params, torch.device("meta"))
    nbytes = sum(p.numel() * p.element_size() for p in sample)
    rates: dict[str, float] = {}
    for name, make in _OPTIMIZERS.items() if nbytes else ():
        optimizer, sink = make(sample), _Sink(model)
        optimizer.step()
        with _Counter(sink):
            optimizer.step()
        rates[name] = sink.work.seconds / nbytes
    return rates


def on_meta(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every device its graph names (torch.export writes the one it traced on into
    ``arange``, ``to`` and metadata asserts) replaced by the meta device, so it runs on meta tensors."""
    meta = torch.device("meta")

    def swap(value: Any) -> Any:
        return meta if isinstance(value, torch.device) else value

    for node in gm.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    gm.recompile()
    return gm


def moe_assumption(module: nn.Module) -> str | None:
    """What the estimate of a mixture-of-experts model assumes, or None for a dense one.

    On meta tensors routing has no values, so which expert gets which token is unknown. The experts'
    grouped product is priced by its total (``top_k x tokens`` tokens, each through one expert) as
    one product of that size: as if every expert got an equal share (balanced experts, what an
    auxiliary load-balancing loss trains towards). Real routing is uneven: small groups run below
    the large product's rate, and where experts run in parallel the slowest sets the pace.
    """
    config = getattr(module, "config", None)
    experts = next(
        (
            getattr(config, k)
            for k in ("num_local_experts", "num_experts", "n_routed_experts")
            if getattr(config, k, None)
        ),
        None,
    )
    if experts is None:
        experts = sum(1 for m in module.modules() if "expert" in type(m).__name__.lower()) or None
    if experts is None:
        return None
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_topk", None) or "k"
    return (
        f"mixture of experts ({experts} experts, top {top_k}): routing is data-dependent and meta "
        "tensors have no data, so every expert is assumed to get an equal share of the tokens "
        "(balanced experts)"
    )
