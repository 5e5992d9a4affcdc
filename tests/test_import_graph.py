"""The library's modules import each other without cycles, counting the imports inside functions:
a function-level import may defer a heavy dependency (torch, transformers, pulp), never hide a circle;
and each library's sub-packages import only those below them (:data:`LAYERS`).

The graph is read from the source (``ast``), so a test of it needs nothing imported."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("partitioner", "runtime", "cli_render")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, here: str, modules: set[str]) -> list[str]:
    """The library modules one import statement names (a package's module, if it names one)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the package of ``here``
            parent = here.split(".")[: -node.level]
            base = ".".join([*parent, base] if base else parent)
        names = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
        ]
    return [name for name in names if name in modules]


@functools.cache  # (read only: the tests share one walk of the source)
def import_graph() -> nx.DiGraph:
    """Module -> the library modules it imports, at module level or inside functions (edges carry
    ``lazy`` when the import sits in a function)."""
    files = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    modules = set(files)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        lazy = {
            id(sub)
            for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
            for sub in ast.walk(fn)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _imported(node, name, modules):
                    if target != name:
                        graph.add_edge(name, target, lazy=id(node) in lazy)
    return graph


def test_no_import_cycles_even_through_function_level_imports() -> None:
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles[:10])


def test_the_walk_sees_both_kinds_of_import() -> None:
    graph = import_graph()
    assert graph.has_edge("partitioner.optimizer.planner", "partitioner.optimizer.pricing.price")
    assert any(lazy for _, _, lazy in graph.edges(data="lazy"))


def test_the_optimizer_imports_nothing_lazily() -> None:
    """The optimizer is pure Python: it has no heavy dependency to defer (pulp's ILP and highspy aside)."""
    lazy = [
        (a, b) for a, b, is_lazy in import_graph().edges(data="lazy")
        if is_lazy and a.startswith("partitioner.optimizer")
    ]  # fmt: skip
    assert not lazy, lazy


# Each library's sub-packages in layers, lowest first: a module imports only its own layer and
# those before it, so a sub-package never reaches up into one that builds on it. A new module or
# sub-package must be placed here (the test names any that is not).
LAYERS = {
    "runtime": (
        ("runtime", "runtime.errors", "runtime.schedule", "runtime.precision"),
        ("runtime.files",),
        ("runtime.faults",),
        ("runtime.packages",),
        ("runtime.observing",),
        ("runtime.executing",),
        ("runtime.settings",),
        ("runtime.datasets",),
        ("runtime.building",),
        ("runtime.checkpoints",),
        ("runtime.job",),
        ("runtime.exporting",),
    ),
    "partitioner": (
        ("partitioner", "partitioner.errors", "partitioner.graph", "partitioner.plan"),
        ("partitioner.optimizer",),
        ("partitioner.hardware",),
        ("partitioner.models",),
        ("partitioner.profiler",),
        ("partitioner.generation",),
        ("partitioner.verification",),
        ("partitioner.calibration",),
        ("partitioner.partition",),
    ),
}


def layer_of(module: str) -> int | None:
    """The layer of ``module`` in its library's :data:`LAYERS`: that of the longest name holding it
    (a library's own name holds only its ``__init__``); None where no name does."""
    found: tuple[int, int] | None = None
    for i, names in enumerate(LAYERS.get(module.split(".")[0], ())):
        for name in names:
            holds = module == name or ("." in name and module.startswith(name + "."))
            if holds and (found is None or len(name) > found[1]):
                found = (i, len(name))
    return None if found is None else found[0]


def test_every_library_module_has_a_layer() -> None:
    unplaced = [m for m in import_graph() if m.split(".")[0] in LAYERS and layer_of(m) is None]
    assert not unplaced, f"modules in no sub-package of LAYERS and not named there: {unplaced}"


def test_sub_packages_import_only_their_own_layer_and_those_below() -> None:
    upward = [
        f"{a} -> {b}" for a, b in import_graph().edges
        if a.split(".")[0] == b.split(".")[0] in LAYERS and (layer_of(b) or 0) > (layer_of(a) or 0)
    ]  # fmt: skip
    assert not upward, "imports up the layers: " + "; ".join(upward)


def test_the_layers_are_read_by_the_longest_name() -> None:
    assert layer_of("partitioner.models.zoo.tiny") == layer_of("partitioner.models") == 3
    assert layer_of("runtime.job.worker") == 10 and layer_of("runtime.schedule") == 0
    assert layer_of("runtime.somewhere") is None  # a flat module must be placed
