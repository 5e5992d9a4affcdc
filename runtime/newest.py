"""The one "newest" finder: what a command works on when the user names no file (the newest profile,
package or trained run), chosen by modification time."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["newest"]


def newest(
    root: str | os.PathLike[str],
    pattern: str,
    missing: Exception,
    keep: Callable[[Path], bool] = lambda _: True,
) -> Path:
    """The most recently modified file under ``root`` that matches ``pattern`` (a ``Path.glob``
    pattern) and ``keep``; of files written in the same instant, the one glob lists last. Raises
    ``missing`` (an error whose message says what to do) where there is none."""
    found = [path for path in Path(root).glob(pattern) if keep(path)]
    if not found:
        raise missing
    return max(reversed(found), key=lambda path: path.stat().st_mtime)
