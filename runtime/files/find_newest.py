"""What a command works on: the newest profile, package or trained run when the user names no file
(chosen by modification time), and a named package folder checked to exist before anything is
written into it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from runtime.errors import RunError

__all__ = ["newest", "newest_package", "package_folder"]


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


def newest_package(root: str | os.PathLike[str] = "models") -> Path:
    """The most recently written package under ``root``: a folder with ``mp_conf.json`` and stage
    code (``__init__.py``; a plan made from a PipeDream graph.txt has none), what ``verify``,
    ``run``, ``export`` and ``fidelity`` work on when no folder is named.

    Raises:
        RunError: no package under ``root``.
    """
    missing = RunError(f"no package under {root}/; write one with `pipeplan partition` or name its folder")
    return newest(root, "**/mp_conf.json", missing, lambda p: (p.parent / "__init__.py").exists()).parent


def package_folder(package: str | Path) -> Path:
    """``package`` as a folder that exists (nothing is written into one that does not).

    Raises:
        RunError: no such folder.
    """
    folder = Path(package)
    if not folder.is_dir():
        raise RunError(f"package {folder} does not exist; run `pipeplan partition` first or pass its folder")
    return folder
