"""What every benchmark shares: a free port for its ranks, a markdown table, and its results pair.

Each benchmark writes ``benchmarks/results/NAME.json`` (the figures, for re-scoring and diffing) and
``NAME.md`` (the table a person reads) together, through the library's one atomic writer, so a
benchmark stopped half-way leaves the previous pair whole.
"""

from __future__ import annotations

import json
import os
import platform
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from runtime.files.atomic import write_text_atomic

RESULTS = Path(__file__).resolve().parent / "results"


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def machine(load: Any, **more: Any) -> dict[str, Any]:
    """The host a figure was measured on: cores, platform, torch, and ``load`` (the load averages
    before and after, as the benchmark recorded them), with ``more`` beside them."""
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "load_average_before_after": load,
        **more,
    }


def table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    """A markdown table's lines: the header, its rule, one line a row (cells as ``str`` gives them).

    ``align`` has a letter a column, ``l`` or ``r`` (right, for figures); missing letters are ``l``.
    """
    rule = ["---:" if align[i : i + 1] == "r" else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def write_results(folder: Path, name: str, doc: Any, markdown: str | Sequence[str], **dumps: Any) -> Path:
    """Write ``folder/name.json`` and ``folder/name.md``, each atomically; returns the JSON's path.

    ``markdown`` is the page, or its lines (joined with a final newline); ``dumps`` passes on to
    ``json.dumps`` (``default=str`` for a document holding paths).
    """
    folder.mkdir(parents=True, exist_ok=True)
    page = markdown if isinstance(markdown, str) else "\n".join(markdown) + "\n"
    path = write_text_atomic(folder / f"{name}.json", json.dumps(doc, indent=1, **dumps) + "\n")
    write_text_atomic(folder / f"{name}.md", page)
    return path
