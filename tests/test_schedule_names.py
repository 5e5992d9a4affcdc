"""Schedules are told apart only by their registries (``runtime.schedule.REGISTRY`` and
``partitioner.optimizer.pricing.schedules.MODELS``): nowhere else does code compare a schedule's name
with a literal one, so adding a schedule is one entry in each and the rest asks them.

Read from the source (``ast``): every comparison (``==``, ``!=``, ``in``, ``not in``) one side of
which is a schedule's name, or a tuple, list or set holding one, is a finding (a profile's
``tracer``, which PipeDream's graph.txt sets to "pipedream" too, is not a schedule)."""

from __future__ import annotations

import ast
from pathlib import Path

from runtime.schedule import SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
REGISTRIES = {
    ROOT / "runtime" / "schedule.py",
    ROOT / "partitioner" / "optimizer" / "pricing" / "schedules.py",
}


def _names(node: ast.expr) -> set[str]:
    """Schedule names a compared expression spells out."""
    if isinstance(node, ast.Constant) and node.value in SCHEDULES:
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_names(e) for e in node.elts)) if node.elts else set()
    return set()


def comparisons(path: Path) -> list[str]:
    """``file:line`` of every comparison with a schedule's name in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        tracer = any(isinstance(x, ast.Attribute) and x.attr == "tracer" for x in sides)
        if not tracer and any(_names(x) for x in sides):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_schedule_names_are_compared_only_in_the_registries() -> None:
    files = [ROOT / "cli.py", *(ROOT / "cli_render").glob("*.py"), *(ROOT / "partitioner").rglob("*.py"),
             *(ROOT / "runtime").rglob("*.py")]  # fmt: skip
    found = [hit for path in files if path not in REGISTRIES for hit in comparisons(path)]
    assert not found, f"schedule names compared outside the registries: {found}"


def test_the_check_finds_a_comparison(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('def f(s: str, p: object) -> bool:\n    return s == "zbv" or s in ("gpipe", "x")\n'
                      'def g(p: object) -> bool:\n    return p.tracer == "pipedream"\n')  # fmt: skip
    assert comparisons(sample) == ["sample.py:2", "sample.py:2"]  # both comparisons, not the tracer
