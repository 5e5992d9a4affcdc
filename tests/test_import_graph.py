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


# cli_render/ only prints: what it takes from the library is data and its formatting, never a function
# that launches, writes or resolves (that is the command's one call into the library, in cli.py).
# Modules that are data, its arithmetic and its formatting throughout: a renderer may import anything.
PURE_MODULES = {
    "runtime.errors",
    "runtime.schedule",
    "partitioner.errors",
    "partitioner.profiler.update_cost",
    "partitioner.optimizer.comparison",
    "partitioner.optimizer.pricing.price",
    "partitioner.optimizer.pricing.schedules",
}
# Modules that also launch, write or resolve: the data types and pure functions a renderer may take.
PURE_NAMES = {
    "partitioner.partition": {"Partitioned", "microbatch_note"},
    "partitioner.calibration.stage_times": {"Calibration", "stage_factors"},
    "partitioner.calibration.link_latency": {"LinkCalibration"},
    "partitioner.optimizer.pricing.simulate": {"gantt"},
    "partitioner.optimizer.layouts": {"layout_name", "tokens_per_device", "utilisation"},
}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The import statements under ``if TYPE_CHECKING:`` (annotations only: nothing imported at run time)."""
    return {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for sub in ast.walk(node)
    }


def library_names(path: Path) -> list[tuple[str, str]]:
    """(module, name) for every partitioner/runtime name the file imports at run time (``import m``:
    (m, m))."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_only(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.module, alias.name) for alias in node.names]
    return [(m, n) for m, n in found if m.split(".")[0] in ("partitioner", "runtime")]


def renderer_violations(path: Path) -> list[str]:
    return [
        f"{path.name}: {module}.{name}"
        for module, name in library_names(path)
        if module not in PURE_MODULES and name not in PURE_NAMES.get(module, ())
    ]


def test_renderers_import_no_library_code_that_launches_writes_or_resolves() -> None:
    renderers = sorted((ROOT / "cli_render").rglob("*.py"))
    assert len(renderers) > 5 and any(library_names(path) for path in renderers)  # (it read something)
    found = [hit for path in renderers for hit in renderer_violations(path)]
    assert not found, f"cli_render/ imports what is no data or format: {found}"
    listed = {*PURE_MODULES, *PURE_NAMES}
    assert listed <= set(import_graph()), f"no such module: {listed - set(import_graph())}"


def test_the_renderer_check_finds_a_launch(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "import runtime.runs\n"
        "from runtime.schedule import get_schedule\n"
        "from partitioner.partition import Partitioned, partition\n"
        "if TYPE_CHECKING:\n    from runtime.job.run_job import RunOutcome\n"
        "def f() -> None:\n    from runtime.job.launch import launch\n"
    )
    assert sorted(renderer_violations(sample)) == [
        "sample.py: partitioner.partition.partition",
        "sample.py: runtime.job.launch.launch",
        "sample.py: runtime.runs.runtime.runs",
    ]


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
        # (the device model is data the 3D pricing reads, so it sits below the optimizer, apart from
        # the clusters of hardware/, which parse with the optimizer's units)
        (
            "partitioner",
            "partitioner.errors",
            "partitioner.sized",
            "partitioner.graph",
            "partitioner.plan",
            "partitioner.hardware.devices",
        ),
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
