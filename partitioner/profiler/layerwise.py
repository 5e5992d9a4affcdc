"""Measure a model one layer at a time, its weights real only while their layer is measured.

A model built without its weights (:func:`runtime.building.meta_params.weightless`) and traced on the meta
device is measured layer by layer: each layer's parameters are made real on the profiling device (random,
with the dtype and shape the model gives them; buffers from their real values), the layer runs on
the real values its producers gave it, is measured as :class:`LayerProfiler` measures it, and its
weights go back to meta. Values are forgotten as soon as no later layer reads them. Peak memory is
one layer's weights, their gradients and its activations, plus the values crossing between layers.

Identical layers are measured once (:mod:`partitioner.profiler.fingerprint`), and a layer whose
twin was measured does not run at all: its float outputs are drawn at random with the shapes and
dtypes its twin's had (the values do not change a dense layer's cost). Twins with integer outputs
run, on weights made real for them, but are not measured again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_flatten, tree_map

from partitioner.profiler.measure import LayerCost, LayerProfiler, _storage_key, _tensors, getattr_path
from partitioner.profiler.trace import Group
from runtime.precision import autocast

__all__ = ["LayerwiseProfiler", "Weights", "tensors_of"]

log = logging.getLogger(__name__)


def tensors_of(gm: nn.Module, members: Sequence[fx.Node]) -> dict[str, Tensor]:
    """The parameters and buffers a layer's nodes use, by their path in ``gm``."""
    found: dict[str, Tensor] = {}
    for m in members:
        if m.op == "call_module":
            sub = gm.get_submodule(str(m.target))
            found.update(sub.named_parameters(prefix=str(m.target), remove_duplicate=False))
            found.update(sub.named_buffers(prefix=str(m.target), remove_duplicate=False))
        elif m.op == "get_attr":
            value = getattr_path(gm, str(m.target))
            if isinstance(value, Tensor):
                found[str(m.target)] = value
    return found


@dataclass
class Weights:
    """Makes a layer's tensors real in a graph whose tensors are on the meta device, and meta again.

    Attributes:
        gm: the traced graph (its parameters and buffers on meta).
        buffers: real buffer values by qualified name (``ModelBundle.buffers``).
        device: where real tensors live.
    """

    gm: nn.Module
    buffers: Mapping[str, Tensor]
    device: torch.device

    @contextlib.contextmanager
    def real(self, paths: Mapping[str, Tensor]) -> Iterator[list[Tensor]]:
        """Inside, every tensor of ``paths`` (path -> its meta tensor) is real in ``gm``: parameters
        random (normal(0, 0.02) matrices, ones for 1-d weights, zeros for biases), buffers their real
        values; one real tensor per meta one (tied weights stay tied). Yields the real tensors."""
        made: dict[int, Tensor] = {}
        for path, meta in paths.items():
            if id(meta) not in made:
                made[id(meta)] = self._make(path, meta)
            self._set(path, made[id(meta)])
        try:
            yield list(made.values())
        finally:
            for path, meta in paths.items():
                self._set(path, meta)

    def _make(self, path: str, meta: Tensor) -> Tensor:
        if meta.device.type != "meta":
            return meta
        if path in self.buffers:
            return self.buffers[path].to(device=self.device, dtype=meta.dtype)
        real = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        if not real.is_floating_point():
            real.zero_()
        elif meta.dim() >= 2:
            real.normal_(0.0, 0.02)
        else:
            real.fill_(1.0 if path.endswith("weight") else 0.0)
        if isinstance(meta, nn.Parameter):
            return nn.Parameter(real, requires_grad=meta.requires_grad)
        log.debug("no real value for %s: filled in", path)
        return real

    def _set(self, path: str, value: Tensor) -> None:
        owner_path, _, leaf = path.rpartition(".")
        owner = self.gm.get_submodule(owner_path) if owner_path else self.gm
        if leaf in owner._parameters:
            owner._parameters[leaf] = value  # type: ignore[assignment]
        elif leaf in owner._buffers:
            owner._buffers[leaf] = value
        else:
            setattr(owner, leaf, value)


class LayerwiseProfiler(LayerProfiler):
    """:class:`LayerProfiler` over a graph whose tensors are on the meta device, group by group.

    Example:
        >>> costs = LayerwiseProfiler(gm, groups, Weights(gm, bundle.buffers, device)).profile(*inputs)
    """

    def __init__(self, gm: fx.GraphModule, groups: Sequence[Group], weights: Weights, **options: Any) -> None:
        super().__init__(gm, groups, device=weights.device, **options)
        self.weights = weights
        self.templates: dict[str, list[Any]] = {}
        """measured group id -> its exported values with tensors as (shape, dtype), for its twins."""
        index = {m: i for i, g in enumerate(self.groups) for m in g.members}
        self.last_read: dict[str, int] = {}
        """graph node -> the index of the last group that reads its value (its own if none does)."""
        for node in gm.graph.nodes:
            readers = [index[u.name] for u in node.users]
            self.last_read[node.name] = max([index[node.name], *readers])

    def profile(self, *inputs: Tensor) -> dict[str, LayerCost]:
        """Measure every group, in the groups' (topological) order; keys are group ids."""
        given = iter(inputs)
        self.env = {n: next(given) for n in self.graph.nodes if n.op == "placeholder"}
        with torch.no_grad():
            for i, group in enumerate(self.groups):
                self.costs[group.id] = self._run_group(group)
                self._forget(i)
                if self.progress:
                    self.progress(len(self.costs), len(self.groups), group.name)
        return self.costs

    def _run_group(self, group: Group) -> LayerCost:
        members = [self.by_name[m] for m in group.members]
        if members[0].op == "placeholder":
            return self._measure(group)
        if members[0].op == "output":
            self.result = self._run_plain(members[0])
            return self._measure(group)
        twin = self.twin_of(group)
        if twin is not None and self._synthesize(group, twin):
            return self._cost(group, twin)
        with self.weights.real(tensors_of(self.module, members)) as real:
            keys = {_storage_key(t)[0] for t in real}
            self.param_storages |= keys
            try:
                for m in members:
                    self.env[m] = self._run_plain(m)
                cost = self._cost(group, twin)
            finally:
                self.param_storages -= keys
        if twin is None:
            self.templates[group.id] = [_template(self.env[m]) for m in self._exported(group)]
        return cost

    def _run_plain(self, node: fx.Node) -> Any:
        with autocast(self.precision, self.device):
            return fx.Interpreter.run_node(self, node)

    def _exported(self, group: Group) -> list[fx.Node]:
        members = [self.by_name[m] for m in group.members]
        return [m for m in members if any(self.member_of[u.name] != group.id for u in m.users)]

    def _synthesize(self, group: Group, twin: str) -> bool:
        """Give the group's exported nodes values shaped as its twin's, without running it; False
        (nothing set) when one of them is a non-float tensor, which only running can make."""
        template = self.templates.get(twin)
        exported = self._exported(group)
        if template is None or len(template) != len(exported):
            return False
        leaves = [leaf for value in template for leaf in tree_flatten(value)[0]]
        if any(isinstance(leaf, _Meta) and not leaf.dtype.is_floating_point for leaf in leaves):
            return False
        for node, value in zip(exported, template, strict=True):
            self.env[node] = tree_map(lambda v: v.make(self.device) if isinstance(v, _Meta) else v, value)
        return True

    def _forget(self, done: int) -> None:
        """Drop every value no group after ``done`` reads. Their storages leave ``seen_saved`` too:
        their memory will hold new tensors, which must not pass for ones already counted."""
        dropped = [n for n in self.env if self.last_read[n.name] <= done]
        keys = {_storage_key(t)[0] for n in dropped for t in _tensors(self.env[n])}
        for node in dropped:
            del self.env[node]
        alive = {_storage_key(t)[0] for value in self.env.values() for t in _tensors(value)}
        self.seen_saved -= keys - alive


@dataclass(frozen=True)
class _Meta:
    """Shape and dtype of a tensor a twin will produce."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def make(self, device: torch.device) -> Tensor:
        return torch.randn(self.shape, device=device).to(self.dtype)


def _template(value: Any) -> Any:
    return tree_map(lambda v: _Meta(tuple(v.shape), v.dtype) if isinstance(v, Tensor) else v, value)
