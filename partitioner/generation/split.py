"""Cut a traced graph into stage graphs by a plan: which fx nodes each stage runs, and what crosses.

The plan assigns profile nodes (and through ``members`` the traced nodes) to stages. Everything the
plan does not mention is placed here: parameters read with ``get_attr`` go to every stage that reads
them, free nodes go to the stage of their inputs, and ``getitem`` of a tuple follows the tuple. Only
tensors cross stages: a non-tensor value (a size, a shape, a list) needed by a later stage is
recomputed there from tensors, so stage signatures name tensors only.
"""

from __future__ import annotations

import builtins
import keyword
import logging
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from partitioner.errors import PlanError
from partitioner.generation.model_output import OutputStructure, output_structure, rebuild

__all__ = [
    "CONSTANT_MAX_ELEMENTS",
    "StageGraph",
    "constant_node",
    "kinds_and_output",
    "split_graph",
    "tensor_kinds",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageGraph:
    """One stage cut out of the traced graph.

    Attributes:
        index: stage position.
        graph: the stage's forward as an fx graph (placeholders = in_names, output = out_names).
        in_names: tensors the stage reads, in forward-argument order.
        out_names: tensors the stage returns, in order.
        modules: original paths of the submodules it calls (held whole, with all their tensors).
        tensors: original names of parameters/buffers it reads directly (``get_attr``).
    """

    index: int
    graph: fx.Graph
    in_names: tuple[str, ...]
    out_names: tuple[str, ...]
    modules: tuple[str, ...]
    tensors: tuple[str, ...]


def tensor_kinds(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> tuple[dict[str, bool], str]:
    """Run the graph once without computing (:func:`partitioner.generation.dry_run.dry_run`; for real where it
    needs values): which nodes produce tensors, and which node produces the loss's input.

    Returns:
        (node name -> produces a tensor, name of the node whose tensor the loss reads).
    """
    kinds, loss_node, _ = kinds_and_output(gm, inputs)
    return kinds, loss_node


def kinds_and_output(
    gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]
) -> tuple[dict[str, bool], str, Any]:
    """:func:`tensor_kinds` and the graph's output from the same run (from a dry run its tensors are
    empty: their shapes are what can be read), so code generation runs the graph once."""
    from partitioner.generation.dry_run import NeedsValues, dry_run
    from runtime.building.stage_init import loss_input

    try:
        output, values = dry_run(gm, inputs)
    except NeedsValues as exc:
        log.info("%s; running the model for real", exc)
        return _kinds_and_output_for_real(gm, inputs)
    kinds = {name: isinstance(value, torch.Tensor) for name, value in values.items()}
    ids = {id(value): name for name, value in values.items() if isinstance(value, torch.Tensor)}
    target = loss_input(output)
    if id(target) not in ids:
        raise PlanError("the model's output tensor is not produced by any traced node")
    return kinds, ids[id(target)], output


def _tensor_kinds_for_real(
    gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]
) -> tuple[dict[str, bool], str]:
    """:func:`tensor_kinds` by running the graph on ``inputs``, for graphs that need values."""
    kinds, loss_node, _ = _kinds_and_output_for_real(gm, inputs)
    return kinds, loss_node


def _kinds_and_output_for_real(
    gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]
) -> tuple[dict[str, bool], str, Any]:
    """:func:`kinds_and_output` by running the graph on ``inputs``, for graphs that need values."""
    from partitioner.generation.dry_run import meta_as_zeros
    from runtime.building.stage_init import loss_input

    kinds: dict[str, bool] = {}
    ids: dict[int, str] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            result = super().run_node(n)
            if n.op == "output":
                return result
            kinds[n.name] = isinstance(result, torch.Tensor)
            if isinstance(result, torch.Tensor):
                ids[id(result)] = n.name  # the latest node wins: the loss tensor is still alive at the end
            return result

    with torch.no_grad(), meta_as_zeros(gm):  # (a graph re-traced without its weights holds them on meta)
        output = Recorder(gm).run(*[t.to("cpu") if t.is_meta else t for t in inputs])
    target = loss_input(output)
    if id(target) not in ids:
        raise PlanError("the model's output tensor is not produced by any traced node")
    return kinds, ids[id(target)], output


def _compute_nodes(gm: fx.GraphModule, drop: frozenset[str] = frozenset()) -> list[fx.Node]:
    return [
        n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr") and n.name not in drop
    ]


def _assign(
    gm: fx.GraphModule, assignment: Mapping[str, int], kinds: Mapping[str, bool], drop: frozenset[str]
) -> dict[fx.Node, int]:
    """Stage of every compute node: the plan's, else its inputs' latest, else its users' earliest."""
    nodes = _compute_nodes(gm, drop)
    stage_of = {n: assignment[n.name] for n in nodes if n.name in assignment}
    for node in nodes:
        if node not in stage_of:
            ins = [stage_of[a] for a in node.all_input_nodes if a in stage_of]
            if ins:
                stage_of[node] = max(ins)
    for node in reversed(nodes):
        if node not in stage_of:
            users = [stage_of[u] for u in node.users if u in stage_of]
            stage_of[node] = min(users) if users else 0
    for node in nodes:  # a getitem of a tuple runs where the tuple is made, so only its tensor crosses
        src = node.args[0] if node.args else None
        if (
            node.target is _getitem()
            and isinstance(src, fx.Node)
            and src in stage_of
            and not kinds.get(src.name)
        ):
            stage_of[node] = stage_of[src]
    return stage_of


def _getitem() -> object:
    import operator

    return operator.getitem


def _members(
    stage: int, stage_of: Mapping[fx.Node, int], kinds: Mapping[str, bool], order: Mapping[fx.Node, int]
) -> list[fx.Node]:
    """The stage's own nodes plus the non-tensor producers it must recompute, in graph order."""
    members = {n for n, s in stage_of.items() if s == stage}
    todo = list(members)
    while todo:
        node = todo.pop()
        for src in node.all_input_nodes:
            if src in members or src not in stage_of:
                continue
            if not kinds.get(src.name, True):
                members.add(src)
                todo.append(src)
            elif stage_of[src] > stage:
                raise PlanError(
                    f"the plan runs {node.name} in stage {stage} before its input {src.name} "
                    f"(stage {stage_of[src]}); stages must follow the graph order"
                )
    return sorted(members, key=order.__getitem__)


def _external(
    members: Iterable[fx.Node], stage_of: Mapping[fx.Node, int], skip: AbstractSet[fx.Node] = frozenset()
) -> set[fx.Node]:
    """Tensors a stage reads that it does not compute (placeholders or other stages' nodes); the
    inputs of ``skip`` nodes (sizes read again from a local tensor) do not count."""
    inside = set(members)
    found: set[fx.Node] = set()
    for node in inside - set(skip):
        for src in node.all_input_nodes:
            if src not in inside and (src.op == "placeholder" or src in stage_of):
                found.add(src)
    return found


def _symbol(value: object) -> str | None:
    return str(value) if isinstance(value, torch.SymInt) else None


def _size_reads(members: Sequence[fx.Node]) -> list[fx.Node]:
    """``sym_size`` nodes of a stage that read a tensor the stage does not compute."""
    inside = set(members)
    return [
        n
        for n in members
        if "sym_size" in str(n.target)
        and n.args
        and isinstance(n.args[0], fx.Node)
        and n.args[0] not in inside
    ]


def _local_sizes(
    members: Sequence[fx.Node], stage_of: Mapping[fx.Node, int]
) -> dict[fx.Node, tuple[fx.Node, int]]:
    """``sym_size`` nodes of a stage that read a tensor it does not otherwise need, each mapped to a
    tensor the stage receives for its own computation with the same symbolic size, and its dimension.

    Candidates are only tensors some non-size node of the stage reads: a tensor the stage would
    receive just for another size read (which may itself be re-sourced) is never one. Without this,
    a later stage would receive the model's input just to read its batch size again.
    """
    reads = _size_reads(members)
    core = _external(members, stage_of, set(reads))
    found: dict[fx.Node, tuple[fx.Node, int]] = {}
    for node in reads:
        symbol = _symbol(node.meta.get("val"))
        if node.args[0] in core or symbol is None:
            continue
        for candidate in sorted(core, key=lambda n: n.name):
            shape = getattr(candidate.meta.get("val"), "shape", ())
            dims = [d for d, size in enumerate(shape) if _symbol(size) == symbol]
            if dims:
                found[node] = (candidate, dims[0])
                break
    return found


def _names(gm: fx.GraphModule, use_module_paths: bool) -> dict[fx.Node, str]:
    """Readable, unique, legal names for values that cross stages (module path prefixed for aten graphs)."""
    names: dict[fx.Node, str] = {}
    taken: set[str] = set()
    for node in gm.graph.nodes:
        name = node.name
        stack = node.meta.get("nn_module_stack") if use_module_paths else None
        paths = [str(p) for p, _ in (stack or {}).values() if not str(p).startswith("_empty_nn_module")]
        if paths and node.op != "call_module":
            path = re.sub(r"\W", "_", paths[-1])
            if path and not name.startswith(path):
                name = f"{path}_{name}"
        name = _snake_case(name)
        if keyword.iskeyword(name) or name in dir(builtins) or name in taken or name == "self":
            name = f"{name}_t"
        taken.add(name)
        names[node] = name
    return names


def _snake_case(name: str) -> str:
    """The name as fx spells a placeholder (``LayerNorm`` -> ``layer_norm``): a signature keeps it."""
    return re.sub(r"(?<=[a-z])([A-Z])", r"_\1", name).lower()


def _devices_from_inputs(graph: fx.Graph) -> None:
    """Replace devices baked in by tracing (torch.export writes ``device=cpu`` into ``arange``/``to``) with
    the device of the stage's first input, so a stage runs on whatever device its rank uses."""
    baked = [
        n for n in graph.nodes if any(isinstance(v, torch.device) for v in (*n.args, *n.kwargs.values()))
    ]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if not baked or not placeholders:
        return
    with graph.inserting_after(placeholders[-1]):
        device = graph.create_node("call_function", getattr, (placeholders[0], "device"), name="input_device")
    for node in baked:
        node.args = tuple(device if isinstance(v, torch.device) else v for v in node.args)
        node.kwargs = {k: device if isinstance(v, torch.device) else v for k, v in node.kwargs.items()}


_DROPOUT_FLAGS = {  # functions whose dropout tracing fixes to training mode: (argument, position)
    torch.nn.functional.dropout: ("training", 2),
    torch.nn.functional.dropout1d: ("training", 2),
    torch.nn.functional.dropout2d: ("training", 2),
    torch.nn.functional.dropout3d: ("training", 2),
    torch.nn.functional.alpha_dropout: ("training", 2),
    torch.nn.functional.feature_alpha_dropout: ("training", 2),
    torch.dropout: ("train", 2),
    torch.ops.aten.dropout.default: ("train", 2),
    torch.ops.aten.native_dropout.default: ("train", 2),
}
_ATTENTION = (
    torch.nn.functional.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)


def _dropout_follows_mode(graph: fx.Graph) -> None:
    """Tracing runs the model in training mode, so ``F.dropout(x, p, training=self.training)`` and
    ``sdpa(..., dropout_p=p if self.training else 0)`` become constants that keep dropping out after
    ``eval()``. Tie them back to the stage module's own ``training`` flag (``self.training``)."""
    baked = [
        n for n in graph.nodes
        if n.op == "call_function" and (n.target in _DROPOUT_FLAGS or n.target in _ATTENTION)
    ]  # fmt: skip
    if not baked:
        return
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        training = graph.get_attr("training")
    for node in baked:
        if node.target in _ATTENTION:
            p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
            if isinstance(p, float) and p > 0:
                with graph.inserting_before(node):
                    scaled = graph.call_function(operator.mul, (p, training))
                _set_argument(node, "dropout_p", 4, scaled)
            continue
        name, position = _DROPOUT_FLAGS[node.target]
        flag = node.kwargs.get(name, node.args[position] if len(node.args) > position else None)
        if flag is True:
            _set_argument(node, name, position, training)
    if not training.users:
        graph.erase_node(training)


def _without_dtype_asserts(graph: fx.Graph) -> None:
    """torch.export asserts the dtype each ``.to()`` saw while tracing in float32
    (``aten._assert_tensor_metadata``); under ``--precision bf16|fp16`` autocast makes those tensors
    low precision, so the asserts would stop the run. They compute nothing: drop them."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            graph.erase_node(node)


def _set_argument(node: fx.Node, name: str, position: int, value: fx.Node) -> None:
    """Set ``node``'s argument ``name``, which it passes at ``position`` or as a keyword."""
    if len(node.args) > position:
        node.args = (*node.args[:position], value, *node.args[position + 1 :])
    else:
        node.kwargs = {**node.kwargs, name: value}


_IN_PLACE_OPERATORS = frozenset(
    (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
     operator.ipow, operator.iand, operator.ior, operator.ixor, operator.imatmul)
)  # fmt: skip


def _writes_first_argument(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``node`` may modify its first argument in place (``ReLU(inplace=True)``, ``x.add_``,
    ``x += y``, ``aten.relu_``); such a node must not touch a tensor received from another stage."""
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).startswith("_")
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    name = getattr(node.target, "__name__", "")
    return (
        node.target in _IN_PLACE_OPERATORS
        or node.kwargs.get("inplace") is True
        or (name.endswith("_") and not name.startswith("_"))
    )


def _clone_inputs_written_in_place(graph: fx.Graph, gm: fx.GraphModule) -> None:
    """A received tensor is an autograd leaf on its rank, which autograd forbids writing in place: give
    the stage a copy of each input that one of its nodes writes (the copy's users see what they did)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        if not any(_writes_first_argument(u, gm) and u.args and u.args[0] is node for u in node.users):
            continue
        with graph.inserting_after(placeholders[-1]):
            copy = graph.create_node("call_method", "clone", (node,), name=f"{node.name}_copy")
        for user in [u for u in node.users if u is not copy]:
            user.replace_input_with(node, copy)


def split_graph(
    gm: fx.GraphModule,
    assignment: Mapping[str, int],
    num_stages: int,
    kinds: Mapping[str, bool],
    use_module_paths: bool = False,
    drop: frozenset[str] = frozenset(),
    constants: Mapping[str, torch.Tensor] | None = None,
) -> tuple[StageGraph, ...]:
    """Cut ``gm`` into ``num_stages`` graphs; ``assignment`` maps traced node names to stages.

    ``drop`` names unused nodes to leave out (torch.export's input-guard check, which no stage needs).
    ``constants`` are tensors the graph reads that are no parameter or buffer of the model (torch.export
    lifts ``torch.tensor(...)`` made inside ``forward`` into such attributes): a stage that reads one
    makes it in its own code instead (see :func:`constant_node`). The last stage returns the
    model's output as the model returns it (:mod:`partitioner.generation.model_output`): every tensor of it is
    computed there or sent there.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    unknown = sorted(set(assignment) - by_name.keys())
    if unknown:
        raise PlanError(
            f"the plan places {len(unknown)} traced nodes the re-traced graph lacks (e.g. {unknown[0]!r}); "
            "the model changed since it was profiled: profile it again"
        )
    stage_of = _assign(gm, assignment, kinds, drop)
    members = [_members(s, stage_of, kinds, order) for s in range(num_stages)]
    resized = [_local_sizes(members[s], stage_of) if s else {} for s in range(num_stages)]
    needs = [_external(m, stage_of, set(resized[s])) for s, m in enumerate(members)]
    structure = output_structure(gm)
    needs[-1] |= {n for n in structure.nodes if n.op == "placeholder" or stage_of.get(n) != num_stages - 1}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = _names(gm, use_module_paths)
    ins: list[list[fx.Node]] = [placeholders] + [
        sorted(needs[s], key=order.__getitem__) for s in range(1, num_stages)
    ]
    outs: list[list[fx.Node]] = []
    for s in range(num_stages):
        later = set().union(*needs[s + 1 :]) if s + 1 < num_stages else set()
        mine = [
            n for n in (placeholders if s == 0 else []) + members[s] if n in later and stage_of.get(n, 0) == s
        ]
        if s == num_stages - 1:
            mine = list(structure.nodes)
        outs.append(sorted(set(mine), key=order.__getitem__))
    for s in range(1, num_stages):
        for node in ins[s]:
            producer = 0 if node.op == "placeholder" else stage_of[node]
            if node not in outs[producer]:
                raise PlanError(f"stage {s} reads {node.name}, which stage {producer} does not produce")
    return tuple(
        _stage_graph(
            gm,
            s,
            members[s],
            ins[s],
            outs[s],
            names,
            resized[s],
            constants or {},
            structure if s == num_stages - 1 else None,
        )
        for s in range(num_stages)
    )


CONSTANT_MAX_ELEMENTS = 4096
"""Largest lifted constant a stage writes into its code; larger ones are refused (see codegen)."""


def constant_node(graph: fx.Graph, value: torch.Tensor) -> fx.Node:
    """A node making ``value`` (``torch.tensor([...], dtype=...)``), so the stage's code holds the
    constant itself: no parameter, no buffer, nothing in a checkpoint. Its device is the stage's
    (``_devices_from_inputs`` replaces the traced one)."""
    return graph.call_function(
        torch.tensor,
        (value.detach().cpu().tolist(),),
        {"dtype": value.dtype, "device": torch.device("cpu")},
    )


def _stage_graph(
    gm: fx.GraphModule,
    index: int,
    members: list[fx.Node],
    ins: list[fx.Node],
    outs: list[fx.Node],
    names: Mapping[fx.Node, str],
    resized: Mapping[fx.Node, tuple[fx.Node, int]],
    constants: Mapping[str, torch.Tensor],
    structure: OutputStructure | None = None,
) -> StageGraph:
    """One stage's graph; the last one (``structure`` given) returns the model's output structure."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in ins:
        env[node] = graph.placeholder(names[node])
        env[node].meta = dict(node.meta)
    inside = set(members)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and any(u in inside for u in node.users):
            target = str(node.target)
            made = constant_node(graph, constants[target]) if target in constants else None
            env[node] = made if made is not None else graph.get_attr(target)
        elif node in inside:
            args = (resized[node][0], resized[node][1]) if node in resized else node.args
            new = graph.create_node(
                node.op,
                node.target,
                fx.map_arg(args, env.__getitem__),
                fx.map_arg(node.kwargs, env.__getitem__),
                names[node],
                node.type,
            )
            new.meta = dict(node.meta)
            env[node] = new
    results = [env[n] for n in outs]
    rebuilt = structure is not None and not structure.is_tensor
    if structure is not None and rebuilt:
        graph.output(rebuild(graph, structure, env.__getitem__))
        outs = [next(n for n in gm.graph.nodes if n.op == "output")]  # the structure, named "output"
    else:
        graph.output(results[0] if len(results) == 1 else tuple(results))
    _devices_from_inputs(graph)
    _dropout_follows_mode(graph)
    _without_dtype_asserts(graph)
    if index > 0:
        _clone_inputs_written_in_place(graph, gm)
    graph.owning_module = gm  # purity checks of call_module nodes and lint look the targets up here
    graph.eliminate_dead_code()
    graph.lint()
    graph.owning_module = None
    for node in graph.nodes:
        if node.op == "placeholder" or (not rebuilt and node in (env[n] for n in outs)):
            expected = names[next(k for k, v in env.items() if v is node)]
            if node.name != expected:
                raise PlanError(f"internal: stage {index} names {expected} as {node.name}")
    used = [n for n in graph.nodes]
    modules = tuple(dict.fromkeys(str(n.target) for n in used if n.op == "call_module"))
    tensors = tuple(
        dict.fromkeys(str(n.target) for n in used if n.op == "get_attr" and n.target != "training")
    )
    return StageGraph(
        index=index,
        graph=graph,
        in_names=tuple(names[n] for n in ins),
        out_names=tuple(names[n] for n in outs),
        modules=modules,
        tensors=tensors,
    )
