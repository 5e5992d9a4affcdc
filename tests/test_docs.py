"""The README stays a first screen, every relative link in it and in docs/ leads to a file, and
design.md's layout names every package folder."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) < 200


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    missing = [link for link in links if "://" not in link and not (page.parent / link).exists()]
    assert missing == []


def test_every_command_shows_an_example_in_its_help() -> None:
    from click.testing import CliRunner

    from cli import main

    missing = [
        name
        for name in main.commands
        if "pipeplan " + name not in CliRunner().invoke(main, [name, "--help"]).output
    ]
    assert missing == []


def test_run_help_reads_at_80_columns_and_docs_run_covers_every_option() -> None:
    """`run --help` is one screen of one-line options; the details live in docs/run.md."""
    from click.testing import CliRunner

    from cli import main

    lines = CliRunner().invoke(main, ["run", "--help"], terminal_width=80).output.splitlines()
    assert max(map(len, lines)) <= 80 and len(lines) <= 80, "\n".join(lines)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "run.md").read_text()
    options = [o for p in main.commands["run"].params for o in p.opts if o.startswith("--")]
    assert [o for o in options if o not in doc] == []


def _layout_folders(text: str) -> set[str]:
    """The folders design.md's layout block names, as paths (two spaces of indent per level)."""
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    found: set[str] = set()
    stack: list[str] = []
    for line in block.splitlines():
        name = line.strip().split(" ")[0] if line.strip() else ""
        if not name.endswith("/") or (len(line) - len(line.lstrip())) % 2:
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        stack = [*stack[:depth], name.rstrip("/")]
        found.add("/".join(stack))
    return found


def test_design_layout_names_every_package_folder() -> None:
    named = _layout_folders((ROOT / "docs" / "design.md").read_text())
    packages = {
        str(init.parent.relative_to(ROOT))
        for top in ("partitioner", "runtime", "cli_render")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert packages - named == set(), "package folders missing from docs/design.md's layout"
    assert {"runtime/job", "partitioner/models/zoo", "partitioner/optimizer/search"} <= named
