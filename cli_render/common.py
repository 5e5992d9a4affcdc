"""The pieces every command's output is made of: the console, an 80-column table, compact numbers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console

__all__ = ["console", "layer_range", "new_table", "note", "num", "plural", "short", "tail"]


def console(stderr: bool = False) -> Console:
    """One Console per stream; commands print tables on stdout and progress/errors on stderr."""
    return Console(stderr=stderr, highlight=False, emoji=False)  # (":llama:" is no emoji in a spec)


def note(text: str) -> None:
    """A yellow ``note:`` line on stderr (the library's remarks that are no errors)."""
    console(stderr=True).print(f"[yellow]note:[/yellow] {text}", soft_wrap=True)


def new_table(title: str, columns: Sequence[str], left: Sequence[str] = ()) -> Any:
    """A table that reads in an 80-column terminal or a log: a rule under the header, no side borders,
    two spaces between columns, numbers never cut or wrapped (units go in the header's second line,
    ``"compute\nms"``; tests/test_cli_tables.py renders every table at 80 columns)."""
    from rich import box
    from rich.table import Table

    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True
    )
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right", no_wrap=column not in left)
    return table


def layer_range(first: str, last: str, count: int) -> str:
    """``features.0..30 (31)``: the first and last layer's names, their shared dotted prefix once."""
    if first == last:
        return f"{first} ({count})"
    a, b = first.split("."), last.split(".")
    pairs = enumerate(zip(a[:-1], b[:-1], strict=False))
    shared = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)) - 1)
    return f"{first}..{'.'.join(b[shared:])} ({count})"


def plural(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else many or one + 's'}"


def num(value: float) -> str:
    """A time or size in at most 6 characters that keeps 4 significant digits (``1410``, ``12.34``)."""
    return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}" if abs(value) < 1000 else f"{value:.0f}"


def tail(name: str, width: int) -> str:
    """A layer's name in a table cell: the end is what tells layers apart (``…layers.5.mlp.down_proj``)."""
    return name if len(name) <= width else "\N{HORIZONTAL ELLIPSIS}" + name[1 - width :]


def short(text: str, width: int = 39) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
