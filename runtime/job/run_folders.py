"""A folder per run: ``PACKAGE/runs/<time>/``, with ``PACKAGE/run`` a symbolic link to the newest.

Why: a second ``pipeplan run`` must not overwrite the first one's metrics, logs and checkpoints, while
every reader that knows ``PACKAGE/run/...`` (calibrate, export, ``--resume``, scripts) keeps finding the
newest run. A package from before this layout has a real ``run/`` folder: it stays readable where it
is, and the next run moves it to ``runs/<its time>/`` before pointing ``run`` at the new one.

``--resume`` continues the newest run in its own folder (its checkpoints, its logs); ``--run-dir``
names a folder explicitly. The nodes of a multi-node job must agree on their folder without talking
to each other, so its default is ``runs/nodes-<master port>/`` rather than a time.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path

from runtime.files.find_newest import package_folder
from runtime.job.run_lock import run_lock
from runtime.settings.run_options import RunOptions

__all__ = ["LATEST", "RUNS", "begin", "discard_if_empty", "latest", "package_lock", "publish", "run_folder"]

RUNS = "runs"
LATEST = "run"


def latest(package: str | Path) -> Path | None:
    """The newest run's folder (where ``PACKAGE/run`` points, resolved so that a run starting
    meanwhile does not change what the caller reads), an older package's real ``run/`` folder, or
    None when the package has no run."""
    link = Path(package) / LATEST
    if link.is_symlink():
        target = link.resolve()
        return target if target.is_dir() else None
    return link if link.is_dir() else None


def run_folder(package: str | Path, run_dir: str | Path | None) -> Path:
    """The run a reader means: ``run_dir`` when given, else the package's newest (``PACKAGE/run``
    when there is none yet, so that the reader's own error names the usual place)."""
    if run_dir is not None:
        return Path(run_dir)
    return latest(package) or Path(package) / LATEST


def package_lock(options: RunOptions) -> AbstractContextManager[None]:
    """One job per package at a time (:mod:`runtime.job.run_lock`), whichever run folder it writes: two
    jobs would still share the package's stages and ``run`` link, and ``pipeplan partition`` asks
    this lock before it replaces the package."""
    return run_lock(package_folder(options.package) / LATEST, options.node_rank)


def begin(options: RunOptions, checkpoints: bool, create: bool = True) -> RunOptions:
    """``options`` with this run's folder filled in, and its checkpoint folder (``<run>/checkpoints``)
    when ``checkpoints`` is on and none was given. With ``create`` (hold :func:`package_lock`) the
    folder is made; :func:`publish` points ``PACKAGE/run`` at it once the run's checks passed."""
    package = Path(options.package)
    if create:
        _move_old_run(package)
    newest = latest(package) if options.resume else None
    if options.run_dir is not None:
        folder = Path(options.run_dir)
    elif newest is not None:
        folder = newest
    else:
        folder = _new_folder(package, options, create)
    if create:
        folder.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = options.checkpoint_dir
    if checkpoints and checkpoint_dir is None:
        checkpoint_dir = str(folder / "checkpoints")
    return replace(options, run_dir=str(folder), checkpoint_dir=checkpoint_dir)


def publish(options: RunOptions) -> None:
    """Point ``PACKAGE/run`` at the run's folder when it lies in ``PACKAGE/runs/`` (a folder named
    elsewhere with ``--run-dir`` is the user's to find)."""
    if _in_runs(options):
        _point(Path(options.package), Path(options.run_dir or ""))


def _in_runs(options: RunOptions) -> bool:
    """Whether the run's folder is one of ``PACKAGE/runs/``."""
    folder = Path(options.run_dir or "")
    return bool(options.run_dir) and folder.resolve().parent == (Path(options.package) / RUNS).resolve()


def discard_if_empty(options: RunOptions) -> None:
    """Remove the run's folder when it holds no file (a run refused before any rank started), so a
    refused run leaves nothing behind; a folder with logs or metrics stays."""
    folder = Path(options.run_dir or "")
    if not options.run_dir or not folder.is_dir() or not _in_runs(options):
        return
    if any(p.is_file() or p.is_symlink() for p in folder.rglob("*")):
        return
    shutil.rmtree(folder, ignore_errors=True)


def _new_folder(package: Path, options: RunOptions, create: bool) -> Path:
    """``runs/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3`` when a run started in the same second), or
    ``runs/nodes-<port>`` for a multi-node job."""
    root = package / RUNS
    if options.nnodes > 1:
        return root / f"nodes-{options.master_port}"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        folder = root / (stamp if n == 1 else f"{stamp}-{n}")
        if not create and not folder.exists():
            return folder
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            continue
    raise FileExistsError(f"{root}: a thousand runs started in {stamp}")


def _move_old_run(package: Path) -> None:
    """An older package's real ``run/`` folder moves to ``runs/<time of its newest file>/``, so that
    ``run`` becomes the link to it; nothing in it changes."""
    old = package / LATEST
    if old.is_symlink() or not old.is_dir():
        return
    stamp = max((p.stat().st_mtime for p in old.iterdir()), default=old.stat().st_mtime)
    target = package / RUNS / time.strftime("%Y%m%d-%H%M%S", time.localtime(stamp))
    while target.exists():
        target = target.with_name(target.name + "-old")
    target.parent.mkdir(parents=True, exist_ok=True)
    old.rename(target)
    _point(package, target)


def _point(package: Path, folder: Path) -> None:
    """Make ``PACKAGE/run`` a relative link to ``folder`` (a new link renamed over the old one: a
    reader sees the old run or the new one, never neither)."""
    tmp = package / f".{LATEST}.{os.getpid()}.link"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(Path(RUNS) / folder.name)
    os.replace(tmp, package / LATEST)
