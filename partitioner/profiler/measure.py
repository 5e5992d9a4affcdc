"""Per-layer cost: forward and backward time, output, saved-for-backward and parameter bytes.

``LayerProfiler`` is an fx ``Interpreter`` (as fx's ``ShapeProp`` is): it runs the graph once without
autograd to capture every node's real input values, and each time a layer's last node has run it
re-executes that layer alone on (copies of) its captured inputs, with autograd on, ``warmup + repeats``
times: forward timed, then backward from the layer's outputs to its inputs and parameters, timed.
The median of each is kept. The warm-up run also counts the bytes autograd saves for backward
(``saved_tensors_hooks``), attributing a tensor saved by several layers to the first, and never counting
parameters. ``measure_step`` times the whole model's forward + loss + backward, the yardstick that
``Profile.fidelity`` compares the layer sum to.

Under a mixed ``precision`` (``bf16``, ``fp16``) every forward (the capture run, each layer's runs,
the loss) runs under autocast as a training rank's does, and every backward outside it: the layers
then read the low-precision tensors their producers really give them, and the bytes saved for
backward include the low-precision copy of each weight that autocast casts once per forward and the
backward keeps (float32 parameters themselves are never counted: the memory model prices those).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_flatten, tree_map

from partitioner.profiler.fingerprint import fingerprint
from partitioner.profiler.meta_autocast import autocast_on
from partitioner.profiler.trace import Group
from partitioner.profiler.working import backward_rise, backward_working, split_deferred
from runtime.executing.split_backward import backward_input, backward_weight
from runtime.precision import autocast

__all__ = [
    "LayerCost",
    "LayerProfiler",
    "StepCost",
    "Stopwatch",
    "measure_loss",
    "measure_loss_memory",
    "measure_step",
]

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs per minibatch.

    Attributes:
        forward_ms: median forward time.
        backward_ms: median backward time (gradients of inputs that need them and of parameters).
        output_bytes: bytes of the tensors other layers read from this one.
        saved_bytes: bytes autograd keeps for backward, first counted here, parameters excluded (and
            their low-precision copies, counted in ``cast_bytes``).
        cast_bytes: bytes of the low-precision copies of parameters that autocast makes in the
            forward and autograd keeps for backward (0 in fp32): once per forward, whatever the batch.
        working_bytes: bytes the backward makes and holds at once beyond ``saved_bytes``, at their
            highest: the gradients of its outputs and inputs and its backward's temporaries
            (:func:`~partitioner.profiler.working.backward_working`; the loss's:
            :func:`measure_loss_memory`).
        deferred_bytes: bytes a split backward keeps from its B to its W
            (:func:`~partitioner.profiler.working.split_deferred`).
        kept_output_bytes: the part of ``output_bytes`` its own backward keeps
            (:meth:`LayerProfiler.kept_output`; ``Node.kept_output_bytes``).
        input_ms: median time of its backward split as zb1p's and zbv's runtime splits it
            (``runtime.executing.split_backward``): B, the input gradients (0 with ``weight_ms`` 0: not
            timed).
        weight_ms: the same split's W, the weight gradients from what B kept.
    """

    forward_ms: float
    backward_ms: float
    output_bytes: int
    saved_bytes: int
    cast_bytes: int = 0
    working_bytes: int = 0
    deferred_bytes: int = 0
    kept_output_bytes: int = 0
    input_ms: float = 0.0
    weight_ms: float = 0.0


@dataclass(frozen=True)
class StepCost:
    """One whole training step (forward, loss, backward) of the untouched model, median of repeats."""

    step_ms: float
    samples_ms: tuple[float, ...]


#: calls a CUDA layer measurement makes back to back between two events (:class:`Stopwatch`).
BACK_TO_BACK = 4
#: a layer whose warm-up took longer (ms) is timed one call at a time: its launches are a
#: negligible share of it, and each call in a batch holds its own inputs and saved activations.
BACK_TO_BACK_BELOW_MS = 5.0


class Stopwatch:
    """Milliseconds of device work: CUDA events after a synchronisation on GPUs, perf_counter on CPU.

    ``clock="cpu"`` counts the process's CPU time instead (all threads): on a CPU shared with other jobs
    it stays close to what an idle machine would show, where wall time also counts the waiting.

    On CUDA a layer measured one call at a time, synchronised, starts on an idle GPU that waits for
    every kernel launch, which a real step overlaps with the kernels before it: on an H100 the sum of
    layer times was 1.23x (vgg16) to 2.35x (resnet50) the whole step. So the profiler times ``calls``
    back-to-back calls between two events with no synchronisation in between (:meth:`time` with
    ``calls``): the host queues ahead as in a step, and the per-call time is the elapsed time over
    ``calls``. Untested on CUDA until a GPU run measures it (``benchmarks/gpu_check.py``).
    """

    def __init__(self, device: torch.device, clock: str = "wall", calls: int | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.clock = time.process_time if clock == "cpu" else time.perf_counter
        self.calls = max(1, calls) if calls is not None else (BACK_TO_BACK if self.cuda else 1)
        """calls a layer measurement makes back to back (1 on a CPU, which runs each synchronously)."""

    @contextmanager
    def time(self, into: list[float], calls: int = 1) -> Iterator[None]:
        """Append the elapsed milliseconds of the ``with`` body over ``calls``: the body makes that
        many calls back to back, with no synchronisation between them."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
            start.record()
            yield
            end.record()
            end.synchronize()
            into.append(start.elapsed_time(end) / max(1, calls))
        else:
            t0 = self.clock()
            yield
            into.append((self.clock() - t0) * 1e3 / max(1, calls))


def _storage_key(t: Tensor) -> tuple[int, int]:
    """(identity, bytes) of a tensor's storage: its address, or for a meta tensor (address 0) the
    address of torch's storage object, so storages are told apart on the meta device too."""
    storage = t.untyped_storage()
    return storage.data_ptr() or storage._cdata, storage.nbytes()


def _tensors(value: Any) -> list[Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, Tensor)]


Origin = tuple[str, int, int]
Role = Origin | None
"""Where a storage a layer saved comes from: ``("in", i, j)``, the j-th tensor of the i-th node outside
the layer that it reads; ``("out", k, j)``, of its k-th exported node; None, made inside the layer.
A layer's twin reads and exports its own tensors in the same order (:func:`outside_inputs`)."""


def outside_inputs(members: Sequence[fx.Node]) -> list[fx.Node]:
    """The nodes outside ``members`` that they read, in the order of first reading (the order
    :func:`~partitioner.profiler.fingerprint.fingerprint` numbers them in, so twins agree)."""
    local, found = set(members), dict[fx.Node, None]()

    def note(arg: Any) -> Any:
        if isinstance(arg, fx.Node) and arg not in local:
            found.setdefault(arg, None)
        return arg

    for m in members:
        fx.node.map_aggregate((m.args, m.kwargs), note)
    return list(found)


class LayerProfiler(fx.Interpreter):
    """Runs a traced model once, measuring each ``Group`` of nodes in isolation as soon as it is complete.

    Example:
        >>> costs = LayerProfiler(traced.graph_module, traced.groups, repeats=3).profile(*inputs)
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        groups: Sequence[Group],
        repeats: int = 3,
        warmup: int = 1,
        progress: Progress | None = None,
        budget_ms: float = 500.0,
        clock: str = "wall",
        precision: str = "fp32",
        reuse: bool = True,
        device: torch.device | None = None,
        calls: int | None = None,
        split: bool = False,
    ) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.precision = precision
        self.split = split
        """also time each layer's backward split into B and W (:meth:`_time_split`)."""
        self.groups = list(groups)
        self.repeats = max(1, repeats)
        self.warmup = max(1, warmup)
        self.progress = progress
        self.budget_ms = budget_ms
        self.result: Any = None
        self.by_name = {n.name: n for n in gm.graph.nodes}
        self.last_of = {g.members[-1]: g for g in self.groups}
        self.member_of = {m: g.id for g in self.groups for m in g.members}
        self.grad_nodes = self._nodes_needing_grad(gm)
        device = device or next((p.device for p in gm.parameters()), torch.device("cpu"))
        self.device = device
        self.stopwatch = Stopwatch(device, clock, calls)
        self.param_storages = {_storage_key(t)[0] for t in [*gm.parameters(), *gm.buffers()]}
        self.seen_saved: set[int] = set()
        self.costs: dict[str, LayerCost] = {}
        self.non_tensor_edges: list[tuple[str, str]] = []
        """(graph node, group id) pairs where a layer reads a non-tensor (a Python int, a shape) from
        another layer: a cut there would have to send it, and only tensors cross pipeline stages."""
        self.reuse = reuse
        self.prints: dict[str, str] = {}
        """fingerprint -> the group measured with it (:mod:`partitioner.profiler.fingerprint`)."""
        self.twins: dict[str, str] = {}
        """group id -> the group whose measurement it shares (``reuse``: identical layers measured once)."""
        self.saves: dict[str, list[tuple[Role, int, bool]]] = {}
        """measured group id -> the distinct storages its forward saved: (where from, bytes, whether
        a weight's cast), so a twin counts its own saves against what earlier layers saved."""

    def profile(self, *inputs: Tensor) -> dict[str, LayerCost]:
        """Measure every group; keys are group ids."""
        with torch.no_grad():
            self.result = self.run(*inputs)
        return self.costs

    def run_node(self, n: fx.Node) -> Any:
        with autocast_on(self.precision, self.device):  # one region per node: layers measure outside it
            result = super().run_node(n)
        group = self.last_of.get(n.name)
        if group is not None:
            self.env[n] = result
            self.costs[group.id] = self._cost(group, self.twin_of(group))
            if self.progress:
                self.progress(len(self.costs), len(self.groups), group.name)
        return result

    def twin_of(self, group: Group) -> str | None:
        """The group already measured that ``group`` is identical to, else None (and ``group``
        becomes the one its later twins share). Reads the values of the group's inputs."""
        members = [self.by_name[m] for m in group.members]
        if not self.reuse or members[0].op in ("placeholder", "output"):
            return None
        key = fingerprint(self.module, members, self.env, self.grad_nodes)
        twin = self.prints.setdefault(key, group.id)
        return None if twin == group.id else twin

    def _cost(self, group: Group, twin: str | None) -> LayerCost:
        """The group's measurement, or its twin's (with its own output bytes) when it has one."""
        self._note_non_tensor_edges(group)
        if twin is None:
            return self._measure(group)
        self.twins[group.id] = twin
        members = [self.by_name[m] for m in group.members]
        exported = [m for m in members if any(self.member_of[u.name] != group.id for u in m.users)]
        out_bytes = sum(t.nbytes for m in exported for t in _tensors(self.env[m]))
        cost = replace(self.costs[twin], output_bytes=out_bytes)
        if twin in self.saves:  # a tensor the twin saved first may have been saved here already
            saved, cast = self._count(self.saves[twin], self._origins(members, exported))
            cost = replace(cost, saved_bytes=saved, cast_bytes=cast)
        return cost

    def _nodes_needing_grad(self, gm: fx.GraphModule) -> set[str]:
        """Nodes whose values depend on a trainable parameter: those get gradients in a real step."""
        needing: set[str] = set()
        for node in gm.graph.nodes:
            own = node.op == "call_module" and any(
                p.requires_grad for p in gm.get_submodule(node.target).parameters()
            )
            if node.op == "get_attr":
                own = isinstance(getattr_path(gm, str(node.target)), nn.Parameter)
            if own or any(a.name in needing for a in node.all_input_nodes):
                needing.add(node.name)
        return needing

    # -------------------------------------------------------------- one group

    def _measure(self, group: Group) -> LayerCost:
        members = [self.by_name[m] for m in group.members]
        if members[0].op in ("placeholder", "output"):
            outputs = self.env[members[0]] if members[0].op == "placeholder" else ()
            return LayerCost(0.0, 0.0, sum(t.nbytes for t in _tensors(outputs)), 0)
        external = {a for m in members for a in m.all_input_nodes if a.name not in group.members}
        exported = [m for m in members if any(self.member_of[u.name] != group.id for u in m.users)]
        params = self._params_of(members)
        saved = cast = working = deferred = 0
        forward: list[float] = []
        backward: list[float] = []
        split: tuple[list[float], list[float]] = ([], [])
        warm: list[float] = []
        for run in range(self.warmup + self.repeats):
            if run > self.warmup and sum(forward) + sum(backward) >= self.budget_ms:
                break  # a slow layer's median needs fewer samples: its relative noise is small
            timed = run >= self.warmup
            calls = self._calls(warm) if timed else 1
            batch = [self._fresh_inputs(external) for _ in range(calls)]
            with self.stopwatch.time(forward if timed else warm, calls):
                done = [self._forward(members, env, run == 0) for _, env, _ in batch]
            if run == 0:
                outs, saved_keys, casts = done[0]
                saved, cast = self._saved_bytes(
                    group.id, members, (saved_keys, batch[0][2], casts), exported, outs
                )
            work = []
            for (leaves, _, _), (outs, _, _) in zip(batch, done, strict=True):
                roots = [t for m in exported for t in _tensors(outs[m.name]) if t.grad_fn is not None]
                if roots and (leaves or params):
                    work.append((roots, [*leaves, *params], [torch.ones_like(t) for t in roots]))
            if run == 0 and work:
                working = backward_working(work[0][0], batch[0][0], work[0][2])
                deferred = split_deferred(work[0][0], batch[0][0], params, work[0][2])
            if work:
                with torch.enable_grad(), self.stopwatch.time(backward if timed else warm, len(work)):
                    for roots, wrt, seeds in work:
                        torch.autograd.grad(roots, wrt, seeds, allow_unused=True)
                if self.split and timed:
                    self._time_split(members, exported, external, params, split)
        out_bytes = sum(t.nbytes for m in exported for t in _tensors(self.env[m]))
        return LayerCost(
            _median(forward), _median(backward), out_bytes, saved, cast, working, deferred,
            self.kept_output(group.id, exported), _median(split[0]), _median(split[1]),
        )  # fmt: skip

    def _time_split(
        self,
        members: list[fx.Node],
        exported: list[fx.Node],
        external: set[fx.Node],
        params: list[Tensor],
        into: tuple[list[float], list[float]],
    ) -> None:
        """Time one backward of the layer as a split schedule's runtime runs it, on a forward of its
        own (untimed): B (``backward_input``: the input gradients, recording what W needs) into
        ``into[0]``, then W (``backward_weight``) into ``into[1]``. Their sum is what zb1p and zbv
        pay for the layer's backward: more than the fused one where a layer is small (B walks the
        graph, W makes one autograd call per weight branch)."""
        leaves, env, _ = self._fresh_inputs(external)
        outs, _, _ = self._forward(members, env, False)
        roots = [t for m in exported for t in _tensors(outs[m.name]) if t.grad_fn is not None]
        if not roots or not (leaves or params):
            return
        seeds: list[Tensor | None] = [torch.ones_like(t) for t in roots]
        with torch.enable_grad():
            with self.stopwatch.time(into[0]):
                _, work = backward_input(roots, seeds, leaves, params)
            with self.stopwatch.time(into[1]):
                backward_weight(work)

    def _calls(self, warm: list[float]) -> int:
        """Back-to-back calls per timing: the stopwatch's, or one for a layer whose warm-up took
        over ``BACK_TO_BACK_BELOW_MS`` (its launches are lost in it)."""
        return 1 if sum(warm) > BACK_TO_BACK_BELOW_MS else self.stopwatch.calls

    def _note_non_tensor_edges(self, group: Group) -> None:
        members = [self.by_name[m] for m in group.members]
        if members[0].op in ("placeholder", "output"):
            return
        external = {a for m in members for a in m.all_input_nodes if a.name not in group.members}
        self.non_tensor_edges.extend(
            (a.name, group.id)
            for a in sorted(external, key=lambda a: a.name)
            if a.op != "get_attr" and any(not isinstance(v, Tensor) for v in tree_flatten(self.env[a])[0])
        )

    def _params_of(self, members: list[fx.Node]) -> list[Tensor]:
        found: dict[int, Tensor] = {}
        for m in members:
            if m.op == "call_module":
                found.update((id(p), p) for p in self.module.get_submodule(str(m.target)).parameters())
            for a in [m, *m.all_input_nodes]:
                if a.op == "get_attr" and isinstance(
                    p := getattr_path(self.module, str(a.target)), nn.Parameter
                ):
                    found[id(p)] = p
        return [p for p in found.values() if p.requires_grad]

    def _fresh_inputs(
        self, external: set[fx.Node]
    ) -> tuple[list[Tensor], dict[fx.Node, Any], dict[int, int]]:
        """Copies of the captured inputs (in-place layers must not touch the originals); grad leaves where
        the real step would compute input gradients. ``aliases`` maps copy storages to original ones."""
        leaves: list[Tensor] = []
        aliases: dict[int, int] = {}
        env: dict[fx.Node, Any] = {}
        for node in external:

            def copy(v: Any, grad: bool = node.name in self.grad_nodes) -> Any:
                if not isinstance(v, Tensor):
                    return v
                if grad and v.is_floating_point():
                    leaf = v.detach().requires_grad_()
                    leaves.append(leaf)
                    with torch.enable_grad():
                        c = leaf.clone()
                else:
                    c = v.clone()
                aliases[_storage_key(c)[0]] = aliases[_storage_key(v)[0]] = _storage_key(v)[0]
                return c

            env[node] = tree_map(copy, self.env[node])
        return leaves, env, aliases

    def _forward(
        self, members: list[fx.Node], env: dict[fx.Node, Any], record_saved: bool
    ) -> tuple[dict[str, Any], list[tuple[int, int]], set[int]]:
        saved: list[tuple[int, int]] = []
        casts: set[int] = set()

        def pack(t: Tensor) -> Tensor:
            saved.append(_storage_key(t))
            if _is_parameter_cast(t):
                casts.add(saved[-1][0])
            return t

        captured, self.env = self.env, env
        try:
            # Its own autocast region, as a rank's forward is: the weight casts are made (and timed)
            # in each run, not cached from an earlier one. The caller times it.
            with torch.enable_grad(), autocast_on(self.precision, self.device):
                if record_saved:
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        outs = {m.name: self._run_member(m) for m in members}
                else:
                    outs = {m.name: self._run_member(m) for m in members}
        finally:
            self.env = captured
        return outs, saved, casts

    def _run_member(self, m: fx.Node) -> Any:
        self.env[m] = fx.Interpreter.run_node(self, m)
        return self.env[m]

    def _saved_bytes(
        self,
        group_id: str,
        members: list[fx.Node],
        forward: tuple[list[tuple[int, int]], Mapping[int, int], set[int]],
        exported: list[fx.Node],
        outs: dict[str, Any],
    ) -> tuple[int, int]:
        """(activation bytes, parameter-cast bytes) of the distinct saved storages, parameters
        excluded; a captured tensor counts at its first saver. ``forward``: the run's saved
        storages, its copies' storages -> the captured ones, and which saved storages are casts."""
        keys, aliases, casts = forward
        for m in exported:
            for copy, original in zip(_tensors(outs[m.name]), _tensors(self.env[m]), strict=False):
                aliases = {**aliases, _storage_key(copy)[0]: _storage_key(original)[0]}
        origins = self._origins(members, exported)
        role_of = {ptr: role for role, ptr in origins.items()}
        entries: dict[Role | int, tuple[Role, int, bool]] = {}
        for ptr, nbytes in keys:
            if ptr in self.param_storages or ptr == 0:
                continue
            role = role_of.get(aliases[ptr]) if ptr in aliases else None
            entries.setdefault(role or ptr, (role, nbytes, ptr in casts))
        self.saves[group_id] = list(entries.values())
        return self._count(self.saves[group_id], origins)

    def kept_output(self, group_id: str, exported: list[fx.Node]) -> int:
        """Bytes of the layer's exported outputs its own forward saved for backward (their roles in
        ``saves``, so a twin's are its own; at most each output's bytes, a view counted as such)."""
        kept = {role for role, _, _ in self.saves.get(group_id, []) if role is not None and role[0] == "out"}
        return sum(
            t.nbytes for k, node in enumerate(exported) for j, t in enumerate(_tensors(self.env.get(node)))
            if ("out", k, j) in kept
        )  # fmt: skip

    def _origins(self, members: list[fx.Node], exported: list[fx.Node]) -> dict[Origin, int]:
        """The captured storage of each of the layer's inputs and exported outputs, by its role."""
        where = {
            ("in", i, j): _storage_key(t)[0]
            for i, node in enumerate(outside_inputs(members))
            for j, t in enumerate(_tensors(self.env.get(node)))
        }
        where.update(
            (("out", k, j), _storage_key(t)[0])
            for k, node in enumerate(exported)
            for j, t in enumerate(_tensors(self.env.get(node)))
        )
        return where

    def _count(self, entries: list[tuple[Role, int, bool]], origins: Mapping[Origin, int]) -> tuple[int, int]:
        """(activation bytes, cast bytes) of ``entries``, skipping captured storages an earlier layer
        saved (or that are parameters) and marking the rest saved."""
        total = cast = 0
        for role, nbytes, is_cast in entries:
            if role is not None and role in origins:
                ptr = origins[role]
                if ptr in self.seen_saved or ptr in self.param_storages:
                    continue
                self.seen_saved.add(ptr)
            if is_cast:
                cast += nbytes
            else:
                total += nbytes
        return total, cast


_VIEWS = frozenset(
    ("TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
     "ReshapeAliasBackward0", "ExpandBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "AliasBackward0")
)  # fmt: skip


def _is_parameter_cast(t: Tensor) -> bool:
    """Whether ``t`` is a dtype copy of a parameter (autocast's cast of a weight), or a view of one
    (``linear`` saves the cast weight transposed): its autograd history is a copy, and views, of one
    parameter and nothing else."""
    fn, copied = t.grad_fn, False
    for _ in range(8):
        if fn is None or len(fn.next_functions) != 1:
            return False
        name = type(fn).__name__
        if name not in _VIEWS and name != "ToCopyBackward0":
            return False
        copied = copied or name == "ToCopyBackward0"
        fn = fn.next_functions[0][0]
        if isinstance(getattr(fn, "variable", None), nn.Parameter):
            return copied
    return False


def getattr_path(root: nn.Module, target: str) -> Any:
    """``root.a.b.c`` for target ``a.b.c``."""
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def measure_step(
    module: nn.Module,
    inputs: Sequence[Tensor] | Mapping[str, Tensor],
    targets: Tensor,
    loss_fn: Callable[[Any, Tensor], Tensor],
    repeats: int = 3,
    warmup: int = 1,
    budget_ms: float = 2000.0,
    clock: str = "wall",
    precision: str = "fp32",
) -> StepCost:
    """Median time of ``loss_fn(module(*inputs), targets).backward()`` (``module(**inputs)`` for a
    mapping; the forward and loss under ``precision``'s autocast), gradients cleared in between.

    Runs ``warmup`` untimed steps, then up to ``repeats`` timed ones, stopping early once the timed
    ones add up to ``budget_ms`` (at least one always runs)."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    stopwatch = Stopwatch(device, clock)
    times: list[float] = []
    for run in range(max(0, warmup) + max(1, repeats)):
        if times and sum(times) >= budget_ms:
            break
        module.zero_grad(set_to_none=True)
        with torch.enable_grad(), stopwatch.time(times if run >= warmup else []):
            with autocast(precision, device):
                output = module(**inputs) if isinstance(inputs, Mapping) else module(*inputs)
                loss = loss_fn(output, targets)
            loss.backward()  # type: ignore[no-untyped-call]
    module.zero_grad(set_to_none=True)
    return StepCost(_median(times), tuple(times))


def measure_loss(
    output: Any,
    targets: Tensor,
    loss_fn: Callable[[Any, Tensor], Tensor],
    repeats: int = 3,
    warmup: int = 1,
    clock: str = "wall",
    precision: str = "fp32",
) -> tuple[float, float]:
    """(forward_ms, backward_ms) of the loss alone on a captured model output (forward under
    ``precision``'s autocast)."""
    logits = [t for t in _tensors(output) if t.is_floating_point()]
    device = logits[0].device if logits else torch.device("cpu")
    stopwatch = Stopwatch(device, clock)
    forward: list[float] = []
    backward: list[float] = []
    for run in range(max(1, warmup) + max(1, repeats)):
        leaf_out = tree_map(
            lambda v: v.detach().requires_grad_() if isinstance(v, Tensor) and v.is_floating_point() else v,
            output,
        )
        with torch.enable_grad():
            with stopwatch.time(forward if run >= warmup else []), autocast(precision, device):
                loss = loss_fn(leaf_out, targets)
            if loss.grad_fn is not None:
                with stopwatch.time(backward if run >= warmup else []):
                    loss.backward()  # type: ignore[no-untyped-call]
    return _median(forward), _median(backward)


def measure_loss_memory(
    output: Any, targets: Tensor, loss_fn: Callable[[Any, Tensor], Tensor], precision: str = "fp32"
) -> tuple[int, int]:
    """(saved, working) bytes of the loss on a captured model output, per minibatch.

    ``saved``: what the loss's forward keeps for its backward (a cross-entropy's log-softmax, as
    large as the logits), targets excluded. ``working``: how far its backward raises the bytes held
    above that, at the highest (the gradients it makes, the one of the model output it passes on
    included, less the saved tensors it frees on the way). A stage holds ``saved`` per item in
    flight and ``working`` once: the layers' own bytes never count these, and on a large vocabulary
    they outweigh all the layers' activations together. Counted from live storages on a CPU (as
    ``pipeplan run --measure-memory`` counts them) and on the meta device (an estimate's), from
    the caching allocator's peak on CUDA (written as torch documents it, untested on CUDA)."""
    leaf_out = tree_map(_grad_leaf, output)
    logits = [t for t in _tensors(leaf_out) if t.requires_grad]
    if not logits:
        return 0, 0
    targets = tree_map(lambda t: t.to(logits[0].device) if isinstance(t, Tensor) else t, targets)
    skip = {_storage_key(t)[0] for t in _tensors(targets)}
    kept: dict[int, Tensor] = {}

    def pack(t: Tensor) -> Tensor:
        key = _storage_key(t)[0]
        if key not in skip and not isinstance(t, nn.Parameter):
            kept[key] = t
        return t

    with torch.enable_grad():
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks, autocast_on(precision, logits[0].device):
            loss = loss_fn(leaf_out, targets)
        saved = sum(t.untyped_storage().nbytes() for t in kept.values())
        if loss.grad_fn is None:
            return 0, 0
        working = backward_rise(
            lambda: torch.autograd.grad(loss, logits, allow_unused=True), loss.device, kept
        )
    return saved, working


def _grad_leaf(v: Any) -> Any:
    """A floating tensor as a fresh leaf that takes a gradient; anything else as it is."""
    return v.detach().requires_grad_() if isinstance(v, Tensor) and v.is_floating_point() else v
