"""One job per package folder at a time: a lock on ``run/``, with who holds it in the message.

Two ``pipeplan run`` of one package would share ``run/``: the second deletes the first one's live
logs, both write ``metrics.json`` and the same checkpoints. The launcher takes an exclusive
``flock`` on ``.run.lock`` beside it (one per node of a multi-node job, whose nodes may share the folder)
before it touches the folder; the kernel releases it when the launcher exits, however it exits,
so a killed run never leaves a stale lock. The lock is held from the launcher's first check to its
end (nested holds in one process are one hold). ``pipeplan partition``, which replaces the package
folder, asks :func:`holder` first.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from runtime.errors import RunError

__all__ = ["holder", "run_lock"]


def _path(run_dir: Path, node: int) -> Path:
    """Beside the run folder (``PACKAGE/.run.lock``), so a refused run creates no folder."""
    return run_dir.with_name(f".{run_dir.name}.lock" + (f".node{node}" if node else ""))


@contextmanager
def run_lock(run_dir: Path, node: int = 0) -> Iterator[None]:
    """Hold the run folder's lock for the block.

    Raises:
        RunError: another job holds it (its pid and host named), or the folder cannot be written.
    """
    path = _path(run_dir, node)
    if not path.parent.is_dir():  # no package there: the launcher's checks say so
        yield
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RunError(f"cannot lock {run_dir}: {exc.strerror or exc}") from exc
    me = _me()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if _who(fd) == me:  # this process holds it already (the CLI around the launcher): nested
                yield
                return
            raise RunError(
                f"{run_dir.parent} is being trained by another `pipeplan run` ({_who(fd)}); wait for it "
                "to end or stop it, or run a copy of the package folder"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{me}\n".encode())
        yield
    finally:
        os.close(fd)


def _me() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def holder(run_dir: Path) -> str | None:
    """Who holds the run folder's lock (``pid N on HOST``), or None when no job runs there."""
    path = _path(run_dir, 0)
    if not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _who(fd)
    else:
        return None
    finally:
        os.close(fd)


def _who(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 200).decode(errors="replace").strip()
    return text or "a process"
