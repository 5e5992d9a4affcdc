"""Atomic file writes: a reader sees the old file or the new one, never half of one.

The one writer of the library's files (profiles, plans, packages' JSON, metrics, exported
weights): the bytes go to a temporary file beside the target, which is renamed onto it once
whole, with the mode ``open`` would have given it. Pure Python: the planner imports it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.errors import RunError

__all__ = ["WriteError", "write_atomic", "write_json_atomic", "write_text_atomic"]


class WriteError(RunError):
    """A file could not be written (its folder not made, not writable, a full disk): path and reason."""


def _umask() -> int:
    """The process umask (read by setting it), so a file gets the mode ``open`` would have given it."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(
    path: str | os.PathLike[str], write: Callable[[Path], object], size: int | None = None
) -> Path:
    """``write(tmp)`` into a temporary file in ``path``'s folder, then rename it onto ``path``.

    Anything ``write`` raises leaves no temporary file behind and propagates as it is, but an
    ``OSError`` (here or in ``write``) becomes one :class:`WriteError`, which says the bytes the
    file needs (``size``, where known) and the bytes free: a full disk is the usual reason.

    Raises:
        WriteError: the folder cannot be created or written, with the reason.
    """
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
        try:
            write(tmp)
            os.chmod(tmp, 0o666 & ~_umask())  # (mkstemp, and safetensors, create files private)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise WriteError(f"cannot write {target}: {exc.strerror or exc}{_needs(target, size)}") from exc
    return target


def _needs(target: Path, size: int | None) -> str:
    """`` (it needs N bytes, M bytes free)``, as much of it as is known."""
    free = ""
    with contextlib.suppress(OSError):
        free = f"{shutil.disk_usage(target.parent).free:,} bytes free"
    needs = [f"it needs {size:,} bytes"] if size is not None else []
    return f" ({', '.join([*needs, free] if free else needs)})" if needs or free else ""


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`write_atomic`)."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), len(text.encode()))


def write_json_atomic(path: str | os.PathLike[str], doc: Any, indent: int | None = 1) -> Path:
    """Write ``doc`` as JSON (one line per field at ``indent`` 1, then a newline) atomically."""
    return write_text_atomic(path, json.dumps(doc, indent=indent) + "\n")
