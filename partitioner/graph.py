"""The layer graph a profile describes: ``Profile`` / ``Node``, profile.json and PipeDream's graph.txt.

This is the contract between the profiler and the optimizer, so it is plain data: no torch import,
frozen dataclasses, and lossless JSON. PipeDream's graph.txt is read (and written) so its published
V100 profiles drive the optimizer exactly as profiles measured by pipeplan do.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partitioner.errors import ProfileFormatError
from partitioner.sized import SizedCost, at_size, sized_from_json, sized_to_json
from runtime.files.atomic import write_text_atomic
from runtime.files.formats import PROFILE_FIELDS
from runtime.files.schema import SchemaError, check
from runtime.precision import PRECISIONS

if TYPE_CHECKING:
    import networkx as nx

__all__ = [
    "PROFILE_SCHEMA",
    "SPLIT_CALL",
    "Node",
    "Profile",
    "TensorSpec",
    "at_microbatches",
    "checked",
    "load_profile",
    "profile_from_json",
    "profile_to_json",
    "read_graph_txt",
    "save_profile",
    "scale_batch",
    "split_backward",
    "write_graph_txt",
]

PROFILE_SCHEMA = "pipeplan.profile/1"

SPLIT_BACKWARD = "split_backward"
"""``Profile.extra`` key of ``{"factor": g, "runs": n}``: a schedule that splits each backward into
B and W (zb1p, zbv) measured g times the fused backward over n runs (``pipeplan calibrate``)."""

SPLIT_CALL = "split_call_ms"
"""``Profile.extra`` key: the fixed milliseconds of one split-backward B call, which each layer's
timed B holds and a stage pays once a microbatch (``partitioner.profiler.split_call``); taken off
every layer's B where it is priced (:func:`at_microbatches`)."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one model input, batch dimension included."""

    shape: tuple[int, ...]
    dtype: str = "float32"


@dataclass(frozen=True)
class Node:
    """One layer of the graph, measured at the profile's batch size.

    Attributes:
        id: stable identifier (the fx node name, or PipeDream's ``nodeN``).
        name: what a person calls it: the module path such as ``features.3``.
        op: ``input``, ``call_module``, ``call_function``, ``call_method`` or ``output``.
        target: the module type (``Conv2d``) or function name (``add``).
        inputs: ids of the nodes whose outputs this node reads.
        forward_ms: forward time per minibatch, milliseconds.
        backward_ms: backward time per minibatch, milliseconds.
        output_bytes: bytes of the output tensors (what crosses a cut after this node).
        saved_bytes: bytes autograd keeps for backward (what a stage holds per microbatch in flight),
            low-precision copies of parameters excluded.
        param_bytes: bytes of parameters owned by this node (a tied parameter counts once, at its first user).
        param_names: qualified names of the parameters this node uses (tied ones included).
        description: free text, e.g. the module's repr or PipeDream's description.
        members: names of the traced graph nodes merged into this node (coarsened free ops, or
            the aten ops of one module under torch.export), in graph order; empty means the
            node is exactly the traced node ``id``. Code generation splits by these.
        cast_bytes: under a mixed precision, bytes of the low-precision copies of its parameters that
            autocast makes in each forward and autograd keeps for backward: made once per forward,
            whatever the batch size (0 in fp32). :func:`at_microbatches` folds them into
            ``saved_bytes`` for a schedule's number of forwards per minibatch.
        forward_fixed_ms: the part of ``forward_ms`` that one call pays whatever its batch (kernel
            launches, Python dispatch), fitted from a second measurement at a smaller batch (0: not
            measured). A minibatch run as M microbatches pays it M times: :func:`at_microbatches`.
        backward_fixed_ms: the same for ``backward_ms``.
        working_bytes: bytes its backward holds at once beyond ``saved_bytes``, at their highest,
            per minibatch: a layer's the gradients of its outputs and inputs and its backward's
            temporaries (:mod:`partitioner.profiler.working`); the loss's its gradient of the
            model's output and its own intermediate gradient (a cross-entropy's two logits-sized
            tensors). One item's backward runs at a time, so a device holds it once, not per item
            in flight (0: not measured, as in profiles written before layers measured it).
        deferred_bytes: bytes a split backward (zb1p, zbv) keeps from this layer's B to its W, per
            minibatch: the gradient B saw flowing into each autograd node whose branch leads only
            to weights, which W needs (``runtime.executing.split_backward``; a linear's, the gradient of its
            output). Held per item between its B and its W (0: not measured).
        kept_output_bytes: the part of ``output_bytes`` its own backward keeps (a ReLU's, a softmax's
            output; counted in its ``saved_bytes``). A stage sending a tensor holds it per item until
            its backward, as autograd's root, unless its producer keeps it; a stage receiving one
            holds its own copy, which the producer's count does not cover where the producer keeps
            it (``StageLoad.sent_bytes``, ``received_bytes``). None: not measured (profiles written
            before, and PipeDream's), and nothing is charged for it.
        tp_param_bytes: the part of ``param_bytes`` that tensor parallelism divides by its degree ``t``
            (a column- or row-wise linear's weight; docs/layout-3d.md); the rest stays whole on every
            tensor rank. 0: the node is not split.
        tp_comm_bytes: bytes a split node all-reduces over its tensor group in the forward per
            minibatch (a row-wise linear's output; the same again in the backward), scaled with the
            batch like ``output_bytes``.
        tp_max: the largest tensor-parallel degree the node divides into (its heads, its hidden
            size); a degree must divide it. 0: the node is not split.
        sized: its times per call at the microbatch sizes it was measured at, with the split
            backward's B and W timed apart (:mod:`partitioner.sized`): what :func:`at_microbatches`
            prices a microbatch from. Empty: not measured (the fixed times, else proportion).
        split_ms: (B, W) ms per minibatch of a split backward at the priced microbatch, written by
            :func:`at_microbatches` from ``sized`` (never read from a file); empty: not measured,
            and a split schedule prices W as a fixed share of ``backward_ms``.
        largest_tensor_bytes: bytes of its largest parameter tensor: the most gradient autograd
            makes at once beside the sum it adds it to (a backward adds each weight's as it is made;
            ``StageLoad.largest_param_bytes``). 0: not measured (profiles written before, and
            PipeDream's), and ``param_bytes`` bounds it.
    """

    id: str
    name: str
    op: str
    target: str
    inputs: tuple[str, ...] = ()
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    output_bytes: int = 0
    saved_bytes: int = 0
    param_bytes: int = 0
    param_names: tuple[str, ...] = ()
    description: str = ""
    members: tuple[str, ...] = ()
    cast_bytes: int = 0
    forward_fixed_ms: float = 0.0
    backward_fixed_ms: float = 0.0
    working_bytes: int = 0
    deferred_bytes: int = 0
    kept_output_bytes: int | None = None
    tp_param_bytes: int = 0
    tp_comm_bytes: int = 0
    tp_max: int = 0
    sized: tuple[SizedCost, ...] = ()
    split_ms: tuple[float, ...] = ()
    largest_tensor_bytes: int = 0

    @property
    def compute_ms(self) -> float:
        """Forward plus backward time: what a stage spends on this node per minibatch."""
        return self.forward_ms + self.backward_ms


@dataclass(frozen=True)
class Profile:
    """A measured layer graph: nodes in topological order plus how they were measured.

    Attributes:
        nodes: every node, inputs first, in a topological order.
        model: the model spec it was traced from (``vgg16``, ``file.py:fn``) or a file name.
        batch_size: samples per minibatch the times refer to; None when the source does not say.
        inputs: shapes and dtypes of the model inputs.
        device: where it was measured (``cpu``, ``cuda:0``, ``V100``).
        dtype: the parameter dtype.
        torch_version: torch's version at measurement, empty when not measured by pipeplan.
        tracer: ``fx``, ``export`` or ``pipedream`` (read from graph.txt).
        tracer_options: what the tracer needs to reproduce the same graph (leaf modules, ...).
        step_ms: one whole forward+backward step measured end to end, if measured.
        tied: groups of parameter names that share one tensor (tied weights).
        extra: anything else worth keeping; never needed by the optimizer.
        precision: ``fp32``, or ``bf16``/``fp16``: measured under autocast to that type (float32
            weights; times, outputs and saved bytes are what mixed-precision training has).
    """

    nodes: tuple[Node, ...]
    model: str = ""
    batch_size: int | None = None
    inputs: tuple[TensorSpec, ...] = ()
    device: str = "cpu"
    dtype: str = "float32"
    torch_version: str = ""
    tracer: str = "fx"
    tracer_options: Mapping[str, Any] = field(default_factory=dict)
    step_ms: float | None = None
    tied: tuple[tuple[str, ...], ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    precision: str = "fp32"

    def node(self, node_id: str) -> Node:
        """The node with this id; KeyError names it when absent."""
        return self._by_id[node_id]

    @functools.cached_property
    def _by_id(self) -> dict[str, Node]:
        """Nodes by id, built once (a 100,000-layer profile is looked up node by node)."""
        return {node.id: node for node in self.nodes}

    def to_networkx(self) -> nx.DiGraph:
        """The layer DAG with nodes as attributes, for graph algorithms (reachability, downsets).
        (networkx is imported here, not with the module: planning a profile.json never needs it.)"""
        import networkx as nx

        graph = nx.DiGraph()
        for node in self.nodes:
            graph.add_node(node.id, node=node)
        for node in self.nodes:
            graph.add_edges_from((src, node.id) for src in node.inputs)
        return graph

    @property
    def layers(self) -> tuple[Node, ...]:
        """Nodes that do work or hold state: everything except inputs and the output marker."""
        return tuple(n for n in self.nodes if n.op not in ("input", "output"))

    @property
    def total_compute_ms(self) -> float:
        """Sum of forward and backward times of all nodes."""
        return math.fsum(n.compute_ms for n in self.nodes)

    @property
    def total_param_bytes(self) -> int:
        """Parameter bytes of the whole model, tied parameters counted once."""
        return sum(n.param_bytes for n in self.nodes)

    @property
    def fidelity(self) -> float | None:
        """Sum of node times over the whole measured step; 1.0 means the parts add up to the whole."""
        if not self.step_ms:
            return None
        return self.total_compute_ms / self.step_ms


def scale_batch(profile: Profile, batch_size: int) -> Profile:
    """The profile of ``batch_size`` samples per minibatch, from one measured at ``profile.batch_size``.

    Times and activation bytes scale with the samples; parameters and their low-precision copies
    (``cast_bytes``, one per forward) and fixed times (one per call) do not. Measuring one microbatch and
    scaling it up gives the cost model (which divides a minibatch's time by the microbatch count) the
    time a 1F1B or GPipe stage really spends per microbatch: small batches cost more per sample.

    Raises:
        ProfileFormatError: the profile does not record the batch size it was measured at.
    """
    if not profile.batch_size:
        raise ProfileFormatError("the profile does not say its batch size, so it cannot be scaled")
    k = batch_size / profile.batch_size
    nodes = tuple(
        replace(n, forward_ms=n.forward_ms * k, backward_ms=n.backward_ms * k,
                output_bytes=round(n.output_bytes * k), saved_bytes=round(n.saved_bytes * k),
                working_bytes=round(n.working_bytes * k), deferred_bytes=round(n.deferred_bytes * k),
                kept_output_bytes=None if n.kept_output_bytes is None else round(n.kept_output_bytes * k),
                tp_comm_bytes=round(n.tp_comm_bytes * k))
        for n in profile.nodes
    )  # fmt: skip
    inputs = tuple(
        replace(t, shape=(batch_size, *t.shape[1:])) if t.shape[:1] == (profile.batch_size,) else t
        for t in profile.inputs
    )
    extra = {**dict(profile.extra), "measured_batch_size": profile.batch_size}
    step = profile.step_ms * k if profile.step_ms else profile.step_ms
    return replace(profile, nodes=nodes, inputs=inputs, batch_size=batch_size, step_ms=step, extra=extra)


def at_microbatches(profile: Profile, forwards: int) -> Profile:
    """The profile of a minibatch that a stage runs as ``forwards`` forwards and backwards (a
    synchronous schedule's microbatches; pipedream: 1): what every search, the simulation and
    calibration price, so they all agree on one count.

    Time: a layer measured at several microbatch sizes (``Node.sized``) is priced ``forwards``
    calls of ``batch_size / forwards`` samples each (:func:`partitioner.sized.at_size`), its split
    backward's B and W with it (``Node.split_ms``), plus what its times hold beyond the calls they
    were measured as (the optimizer's update, once a minibatch: on W where split). Otherwise two
    costs are per call, not per sample: each call pays the node's fixed time, and the profile's
    times already hold ``batch_size / measured batch size`` of them (one, unless measured at a
    microbatch and scaled up), so the difference is added (or taken away).

    Memory: every forward under autocast keeps its own low-precision copy of the weights it casts
    until its backward, so a minibatch of M microbatches holds M copies where its activations add
    up to one minibatch's: the memory model, which divides ``saved_bytes`` by M per microbatch in
    flight, then charges each microbatch one copy. Idempotent: the result has no ``cast_bytes``,
    fixed times or sizes left.
    """
    if not any(n.cast_bytes or n.forward_fixed_ms or n.backward_fixed_ms or n.sized for n in profile.nodes):
        return profile
    measured = profile.extra.get("measured_batch_size") or profile.batch_size
    extra_calls = forwards - (profile.batch_size / measured if profile.batch_size and measured else 1.0)
    samples = profile.batch_size / forwards if profile.batch_size else None
    fixed_b = profile.extra.get(SPLIT_CALL)
    split_call = float(fixed_b) if isinstance(fixed_b, int | float) else 0.0

    def charged(n: Node) -> Node:
        times: dict[str, Any] = {
            "forward_ms": max(0.0, n.forward_ms + extra_calls * n.forward_fixed_ms),
            "backward_ms": max(0.0, n.backward_ms + extra_calls * n.backward_fixed_ms),
        }
        if n.sized and samples and profile.batch_size and measured:
            # what the node's times hold beyond its measured calls (the optimizer's update, paid once
            # a minibatch: ``partitioner.profiler.update_cost.with_update_time``) is kept as it is
            whole, k = at_size(n.sized, measured), profile.batch_size / measured
            rest_f, rest_b = n.forward_ms - k * whole.forward_ms, n.backward_ms - k * whole.backward_ms
            call = at_size(n.sized, samples)
            times = {
                "forward_ms": max(0.0, forwards * call.forward_ms + rest_f),
                "backward_ms": max(0.0, forwards * call.backward_ms + rest_b),
            }
            if call.split:
                b = max(0.0, call.input_ms - split_call)  # the fixed part: paid by the stage's B call
                times["split_ms"] = (forwards * b, max(0.0, forwards * call.weight_ms + rest_b))
            times["sized"] = ()
        return replace(
            n,
            **times,
            saved_bytes=n.saved_bytes + forwards * n.cast_bytes,
            cast_bytes=0,
            forward_fixed_ms=0.0,
            backward_fixed_ms=0.0,
        )

    return replace(profile, nodes=tuple(charged(n) for n in profile.nodes))


def split_backward(profile: Profile) -> Profile:
    """The profile as a schedule that splits each backward into B and W (zb1p, zbv) runs it.

    A layer whose B and W were timed apart (``Node.split_ms``, from :func:`at_microbatches`) costs
    their sum: the runtime's W makes one autograd call per weight branch and B walks the stage's
    graph, fixed costs that the fused backward does not pay (1.39x on two decoder layers of hidden
    64, 1.00x at hidden 512: ``benchmarks/bench_split_backward.py``). Where calibrate measured a
    factor from such runs (:data:`SPLIT_BACKWARD`), every backward is the fused one times it (B and
    W in their measured proportion), and the factor is dropped, so a second call changes nothing.
    A profile with neither is returned as is."""
    measured = profile.extra.get(SPLIT_BACKWARD)
    factor = isinstance(measured, Mapping) and "factor" in measured
    if not factor and not any(n.split_ms for n in profile.nodes):
        return profile
    g = float(measured["factor"]) if factor and isinstance(measured, Mapping) else None
    extra = {k: v for k, v in profile.extra.items() if k != SPLIT_BACKWARD}

    def split(n: Node) -> Node:
        if g is None:
            return replace(n, backward_ms=math.fsum(n.split_ms)) if n.split_ms else n
        backward = n.backward_ms * g
        total = math.fsum(n.split_ms)
        parts = tuple(p * backward / total for p in n.split_ms) if n.split_ms and total > 0 else n.split_ms
        return replace(n, backward_ms=backward, backward_fixed_ms=n.backward_fixed_ms * g, split_ms=parts)

    return replace(profile, nodes=tuple(split(n) for n in profile.nodes), extra=extra)


def profile_to_json(profile: Profile) -> dict[str, Any]:
    """The profile.json document (schema ``pipeplan.profile/1``)."""
    doc: dict[str, Any] = {"schema": PROFILE_SCHEMA}
    doc.update(asdict(profile))
    doc["tracer_options"] = dict(profile.tracer_options)
    doc["extra"] = dict(profile.extra)
    doc["fidelity"] = profile.fidelity
    for node in doc["nodes"]:  # only nodes tensor parallelism splits say so (older readers never see it)
        for key in ("tp_param_bytes", "tp_comm_bytes", "tp_max", "sized", "largest_tensor_bytes"):
            if not node[key]:
                del node[key]
        if "sized" in node:
            node["sized"] = sized_to_json([SizedCost(**e) for e in node["sized"]])
        del node["split_ms"]  # derived at pricing, never stored
    return doc


def profile_from_json(doc: Mapping[str, Any], source: str = "profile") -> Profile:
    """Parse a profile.json document; ProfileFormatError says what is wrong with it."""
    if not isinstance(doc, Mapping) or doc.get("schema") != PROFILE_SCHEMA:
        found = doc.get("schema") if isinstance(doc, Mapping) else type(doc).__name__
        raise ProfileFormatError(
            f"{source} is not a pipeplan profile (schema {found!r}, expected {PROFILE_SCHEMA!r}); "
            "write one with `pipeplan profile MODEL`"
        )
    try:
        check(doc, PROFILE_FIELDS, source)
    except SchemaError as exc:
        raise ProfileFormatError(f"{exc}; write profiles with `pipeplan profile`") from None
    try:
        nodes = tuple(_node_from_json(n) for n in doc["nodes"])
        profile = Profile(
            nodes=nodes,
            model=str(doc.get("model", "")),
            batch_size=doc.get("batch_size"),
            inputs=tuple(
                TensorSpec(tuple(int(d) for d in t["shape"]), str(t.get("dtype", "float32")))
                for t in doc.get("inputs", ())
            ),
            device=str(doc.get("device", "cpu")),
            dtype=str(doc.get("dtype", "float32")),
            precision=str(doc.get("precision") or "fp32"),  # profiles from before precision: fp32
            torch_version=str(doc.get("torch_version", "")),
            tracer=str(doc.get("tracer", "fx")),
            tracer_options=dict(doc.get("tracer_options", {})),
            step_ms=doc.get("step_ms"),
            tied=tuple(tuple(str(p) for p in group) for group in doc.get("tied", ())),
            extra=dict(doc.get("extra", {})),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileFormatError(f"{source} is corrupt: bad or missing field {exc}") from exc
    return checked(profile, source)


def _node_from_json(doc: Mapping[str, Any]) -> Node:
    missing = [key for key in ("forward_ms", "backward_ms") if key not in doc]
    if missing:
        raise KeyError(f"{missing[0]} of node {doc.get('id')!r}")
    return Node(
        id=str(doc["id"]),
        name=str(doc.get("name", doc["id"])),
        op=str(doc["op"]),
        target=str(doc.get("target", "")),
        inputs=tuple(str(i) for i in doc.get("inputs", ())),
        forward_ms=float(doc.get("forward_ms", 0.0)),
        backward_ms=float(doc.get("backward_ms", 0.0)),
        output_bytes=int(doc.get("output_bytes", 0)),
        saved_bytes=int(doc.get("saved_bytes", 0)),
        cast_bytes=int(doc.get("cast_bytes", 0)),
        working_bytes=int(doc.get("working_bytes", 0)),
        deferred_bytes=int(doc.get("deferred_bytes", 0)),
        kept_output_bytes=None if doc.get("kept_output_bytes") is None else int(doc["kept_output_bytes"]),
        forward_fixed_ms=float(doc.get("forward_fixed_ms", 0.0)),
        backward_fixed_ms=float(doc.get("backward_fixed_ms", 0.0)),
        param_bytes=int(doc.get("param_bytes", 0)),
        param_names=tuple(str(p) for p in doc.get("param_names", ())),
        description=str(doc.get("description", "")),
        members=tuple(str(m) for m in doc.get("members", ())),
        tp_param_bytes=int(doc.get("tp_param_bytes", 0)),
        tp_comm_bytes=int(doc.get("tp_comm_bytes", 0)),
        tp_max=int(doc.get("tp_max", 0)),
        sized=sized_from_json(doc.get("sized", ())),
        largest_tensor_bytes=int(doc.get("largest_tensor_bytes", 0)),
    )


def checked(profile: Profile, source: str = "profile") -> Profile:
    """The profile itself, once it is a graph the optimizer can trust: unique ids, every input an earlier
    node (a DAG in topological order), finite non-negative times and sizes, a positive batch size.

    Raises:
        ProfileFormatError: naming the first node and field that break this.
    """
    batch = profile.batch_size
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ProfileFormatError(f"{source}: batch_size must be a positive integer or null, got {batch!r}")
    if profile.precision not in PRECISIONS:
        raise ProfileFormatError(
            f"{source}: precision must be one of {', '.join(PRECISIONS)}, got {profile.precision!r}"
        )
    if profile.step_ms is not None and not _non_negative(profile.step_ms):
        raise ProfileFormatError(f"{source}: step_ms must be a finite number >= 0, got {profile.step_ms!r}")
    seen: set[str] = set()
    for node in profile.nodes:
        if node.id in seen:
            raise ProfileFormatError(f"{source}: node id {node.id!r} appears twice; ids must be unique")
        fields = ("forward_ms", "backward_ms", "output_bytes", "saved_bytes", "cast_bytes", "param_bytes",
                  "forward_fixed_ms", "backward_fixed_ms", "working_bytes", "deferred_bytes",
                  "largest_tensor_bytes")  # fmt: skip
        for field_name in fields:
            value = getattr(node, field_name)
            if not _non_negative(value):
                raise ProfileFormatError(
                    f"{source}: node {node.id!r} has {field_name}={value!r}; it must be a finite number >= 0"
                )
        kept = node.kept_output_bytes
        if kept is not None and not (_non_negative(kept) and kept <= node.output_bytes):
            raise ProfileFormatError(
                f"{source}: node {node.id!r} has kept_output_bytes={kept!r}; it must be between 0 and its "
                f"output_bytes ({node.output_bytes})"
            )
        _check_inputs(profile, node, seen, source)
        seen.add(node.id)
    return profile


def _non_negative(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _check_inputs(profile: Profile, node: Node, earlier: set[str], source: str) -> None:
    """Every input of ``node`` is a node listed before it; say whether an offender is unknown or a cycle."""
    for src in node.inputs:
        if src in earlier:
            continue
        if all(n.id != src for n in profile.nodes):
            raise ProfileFormatError(
                f"{source}: node {node.id!r} reads {src!r}, which is not a node of the profile"
            )
        import networkx as nx

        if not nx.is_directed_acyclic_graph(profile.to_networkx()):
            cycle = " -> ".join(a for a, _ in nx.find_cycle(profile.to_networkx()))
            raise ProfileFormatError(f"{source} has a cycle ({cycle}): a layer graph must be acyclic")
        raise ProfileFormatError(
            f"{source}: node {node.id!r} reads {src!r}, listed after it; nodes must be in topological order"
        )


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> Path:
    """Write profile.json atomically."""
    return write_text_atomic(path, json.dumps(profile_to_json(profile), indent=1) + "\n")


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read a profile.json, or a PipeDream graph.txt (by content, not by name)."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileFormatError(f"cannot read profile {source}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ProfileFormatError(
            f"{source} is not a text file; give a profile.json or a PipeDream graph.txt"
        ) from exc
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileFormatError(f"{source} is not valid JSON: {exc}") from exc
        return profile_from_json(doc, str(source))
    return parse_graph_txt(text, str(source))


# ---------------------------------------------------------------- PipeDream graph.txt

_NODE_LINE = re.compile(r"^(?P<id>\S+) -- (?P<desc>.*?) -- (?P<metrics>forward_compute_time=.*)$")
_EDGE_LINE = re.compile(r"^\t(?P<src>\S+) -- (?P<dst>\S+)\s*$")
_METRIC = re.compile(r"(\w+)=(\[[^\]]*\]|[^,]+)")


def read_graph_txt(path: str | os.PathLike[str], batch_size: int | None = None) -> Profile:
    """Read PipeDream's graph.txt; ``batch_size`` is the one it was profiled at, if known."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileFormatError(f"cannot read {source}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ProfileFormatError(f"{source} is not a text file; give a PipeDream graph.txt") from exc
    profile = parse_graph_txt(text, str(source))
    return replace(profile, batch_size=batch_size) if batch_size else profile


def parse_graph_txt(text: str, source: str = "graph.txt") -> Profile:
    """Parse graph.txt text: node lines, then tab-indented edge lines."""
    raw: dict[str, dict[str, Any]] = {}
    edges: list[tuple[str, str]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if edge := _EDGE_LINE.match(line):
            edges.append((edge["src"], edge["dst"]))
        elif node := _NODE_LINE.match(line):
            try:
                raw[node["id"]] = {"desc": node["desc"], **_parse_metrics(node["metrics"])}
            except ValueError as exc:
                raise ProfileFormatError(f"{source}:{lineno}: {exc}; every metric must be a number") from exc
        else:
            raise ProfileFormatError(
                f"{source}:{lineno} is neither a graph.txt node nor an edge line: {line[:60]!r}"
            )
    if not raw:
        raise ProfileFormatError(f"{source} has no nodes: not a PipeDream graph.txt")
    unknown = {n for edge in edges for n in edge} - raw.keys()
    if unknown:
        raise ProfileFormatError(f"{source} has edges to unknown nodes: {sorted(unknown)[:3]}")
    profile = Profile(
        nodes=_graph_nodes(raw, edges, source),
        model=Path(source).parent.name,
        device="pipedream",
        tracer="pipedream",
    )
    return checked(profile, source)


def _number(key: str, text: str) -> float:
    """One graph.txt metric value; ValueError names the metric."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{key}={text.strip()!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{key}={text.strip()!r} is not a finite number")
    return value


def _parse_metrics(text: str) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    for key, value in _METRIC.findall(text):
        if value.startswith("["):
            parts = [_number(key, v) for v in value.strip("[]").split(";") if v.strip()]
            metrics[key] = sum(parts)
            metrics[key + "_list"] = parts
        elif key == "stage_id":
            metrics[key] = int(_number(key, value))
        else:
            metrics[key] = _number(key, value)
    return metrics


def _graph_nodes(
    raw: Mapping[str, Mapping[str, Any]], edges: Iterable[tuple[str, str]], source: str
) -> tuple[Node, ...]:
    import networkx as nx

    graph = nx.DiGraph()
    order = {node_id: i for i, node_id in enumerate(raw)}
    graph.add_nodes_from(raw)
    graph.add_edges_from(edges)
    if not nx.is_directed_acyclic_graph(graph):
        raise ProfileFormatError(f"{source} has a cycle: not a layer DAG")
    topo = list(nx.lexicographical_topological_sort(graph, key=order.__getitem__))
    position = {node_id: i for i, node_id in enumerate(topo)}
    nodes = []
    for node_id in topo:
        info = raw[node_id]
        desc = str(info["desc"])
        is_input = desc.startswith("Input")
        nodes.append(
            Node(
                id=node_id,
                name=node_id,
                op="input" if is_input else "call_module",
                target=desc.split("(")[0],
                inputs=tuple(sorted(graph.predecessors(node_id), key=position.__getitem__)),
                forward_ms=float(info.get("forward_compute_time", 0.0)),
                backward_ms=float(info.get("backward_compute_time", 0.0)),
                output_bytes=round(float(info.get("activation_size", 0.0))),
                saved_bytes=0 if is_input else round(float(info.get("activation_size", 0.0))),
                param_bytes=round(float(info.get("parameter_size", 0.0))),
                description=desc,
            )
        )
    return tuple(nodes)


def write_graph_txt(profile: Profile, path: str | os.PathLike[str]) -> Path:
    """Write the profile as PipeDream's graph.txt (times in ms, sizes in bytes)."""
    lines = []
    for node in profile.nodes:
        desc = node.description or ("Input" if node.op == "input" else f"{node.target}({node.name})")
        lines.append(
            f"{node.id} -- {desc} -- forward_compute_time={node.forward_ms:.3f}, "
            f"backward_compute_time={node.backward_ms:.3f}, "
            f"activation_size={float(node.output_bytes):.3f}, "
            f"parameter_size={float(node.param_bytes):.3f}"
        )
    for node in profile.nodes:
        lines.extend(f"\t{src} -- {node.id}" for src in node.inputs)
    return write_text_atomic(path, "\n".join(lines) + "\n")
