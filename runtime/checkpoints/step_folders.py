"""Checkpoints on disk: ``D/step-<N>/`` is the whole job's training state after N minibatches.

A step folder is one torch.distributed.checkpoint (DCP): ``__<rank>_0.distcp`` files that the ranks
write in parallel, each its own, and DCP's ``.metadata``, written by rank 0 once every rank's data is
on disk; what they hold and under which names is :mod:`runtime.checkpoints.train_state`. Beside them
``meta.json`` records the run (settings, plan, model; :mod:`runtime.checkpoints.resume_settings` compares it
with a resumed run). The ranks write into ``step-N.partial/``; rank 0 adds ``meta.json`` and renames the
folder to ``step-N`` once DCP has finished, so a ``step-N`` folder is always complete: a rank killed
mid-write leaves only a ``.partial`` folder, which the next ``--resume`` removes. With
:attr:`Saver.background` the ranks copy their tensors and go on training while DCP writes
(``dcp_async_save``); the next checkpoint, and the end of the run, wait for it.

A checkpoint folder may keep only its newest ``keep`` steps (:func:`prune`), plus steps the run pins
and steps a user pinned by putting a file named ``pinned`` into the folder.

Checkpoints of pipeplan before DCP (``pipeplan.checkpoint/1``: ``stage<K>.pt`` per stage) are refused
by ``--resume`` with the command that converts them (:mod:`runtime.checkpoints.convert_v1`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from runtime.checkpoints import safe_read
from runtime.errors import PeerLost, RunError
from runtime.files.atomic import write_json_atomic

__all__ = [
    "META",
    "PINNED",
    "SCHEMA",
    "ResumePoint",
    "Saver",
    "is_v1",
    "last_complete",
    "package_fingerprint",
    "prune",
    "publish",
    "read_meta",
    "resume_point",
    "saved_tensors",
    "step_dir",
    "step_problem",
    "steps_in",
    "v1_hint",
    "write_error",
]

META = "meta.json"
PINNED = "pinned"
SCHEMA = "pipeplan.checkpoint/2"
_STEP = re.compile(r"^step-(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def steps_in(root: Path) -> list[int]:
    """The steps that have a ``step-N`` folder under ``root``, newest first."""
    names = [c.name for c in root.iterdir()] if root.is_dir() else []
    return sorted((int(m[1]) for name in names if (m := _STEP.match(name))), reverse=True)


def package_fingerprint(package: Path) -> str:
    """A hash of a package's layout (mp_conf.json and every stage's code): equal fingerprints, the same
    stages on the same ranks, so each rank's random generator states still belong to it."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted([package / "mp_conf.json", *package.glob("stage*.py")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def is_v1(root: Path, step: int) -> bool:
    """Whether ``step-N`` is a checkpoint of pipeplan before DCP (``stage<K>.pt`` files)."""
    return (step_dir(root, step) / "stage0.pt").is_file()


def v1_hint(root: Path, step: int) -> str:
    """The one line that says how to convert a checkpoint of pipeplan before DCP."""
    package = "PACKAGE"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        package = str(json.loads((step_dir(root, step) / META).read_text(encoding="utf-8"))["package"])
    return (
        f"{step_dir(root, step)} is a per-stage checkpoint of an earlier pipeplan (stage<K>.pt files); "
        f"convert it once with `pipeplan convert-checkpoint {root} --package {package}`, then resume "
        "(on any plan of the model)"
    )


def read_meta(root: Path, step: int) -> dict[str, Any]:
    """``step-N/meta.json``, checked to be this format's.

    Raises:
        RunError: missing, unreadable or of another format.
    """
    path = step_dir(root, step) / META
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RunError(f"cannot read {path}: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("step"), int):
        raise RunError(
            f"{path} is not a {SCHEMA} record (schema {doc.get('schema') if isinstance(doc, dict) else '?'})"
        )
    return doc


def _recorded_problem(folder: Path, files: dict[str, Any]) -> str | None:
    """Why a file ``meta.json`` recorded (size and sha256) is not the one that was written, or None."""
    for name, want in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            return f"incomplete, no {name}"
        size = path.stat().st_size
        if size < int(want["bytes"]):
            return f"{name} is truncated ({size} of {want['bytes']} bytes)"
        if size != int(want["bytes"]) or safe_read.file_digest(path) != want["sha256"]:
            return (
                f"{name} is not the file that was written (its sha256 differs from the one meta.json "
                "recorded): changed or damaged since"
            )
    return None


_UNREADABLE: tuple[type[Exception], ...] = (RunError, OSError, pickle.UnpicklingError, EOFError)
_UNREADABLE += (AttributeError, ValueError, LookupError, TypeError)
"""What a damaged ``meta.json`` or ``.metadata`` raises when read."""


def step_problem(root: Path, step: int) -> str | None:
    """Why ``step`` cannot be resumed from or exported (a missing, short, changed or unreadable file), or
    None. Each file's size and sha256 (recorded in ``meta.json`` by the run that wrote it) is checked
    before anything is unpickled, so a changed file is never read.

    Raises:
        safe_read.Refused: the step holds a Python object that is not data, in files whose digests
            match (or that a run before digests wrote): refused, not skipped.
    """
    folder = step_dir(root, step)
    if is_v1(root, step):
        return "a per-stage checkpoint of an earlier pipeplan (convert it with `pipeplan convert-checkpoint`)"
    for name in (META, ".metadata"):
        if not (folder / name).is_file():
            return f"incomplete, no {name}"
    try:
        files = read_meta(root, step).get("files")
        problem = _recorded_problem(folder, files) if isinstance(files, dict) else None
        if problem:
            return problem
        metadata = safe_read.read_metadata(folder)
    except safe_read.Refused:
        raise
    except _UNREADABLE as exc:
        return f"unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = folder / name
        if not path.is_file():
            return f"incomplete, no {name}"
        if path.stat().st_size < end:
            return f"{name} is truncated ({path.stat().st_size} of {end} bytes)"
        if isinstance(files, dict) and name not in files:
            return f"{name} is not among the files meta.json recorded"
    safe_read.check_values(folder)
    return None


def saved_tensors(root: Path, step: int, prefix: str = "model.") -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors a step holds under ``prefix`` (without it), with shape and dtype, from DCP's metadata."""
    metadata = safe_read.read_metadata(step_dir(root, step))
    return {
        key.removeprefix(prefix): (tuple(md.size), str(md.properties.dtype).removeprefix("torch."))
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }


def last_complete(root: Path) -> tuple[int, int] | None:
    """The newest published step (its ``meta.json`` written: the rename made it whole) and the bytes
    its files take, which is what the next step needs; None without one. Nothing is read or hashed."""
    for step in steps_in(root):
        folder = step_dir(root, step)
        if (folder / META).is_file() and not is_v1(root, step):
            with contextlib.suppress(OSError):
                return step, sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    return None


@dataclass(frozen=True)
class ResumePoint:
    """Where ``--resume`` continues.

    Attributes:
        step: the step to continue after; None: no usable checkpoint, start from step 0.
        skipped: one line per newer step that could not be used, and why.
        removed: leftovers of interrupted writes that were deleted.
    """

    step: int | None
    skipped: tuple[str, ...] = ()
    removed: int = 0


def _remove_leftovers(root: Path) -> int:
    """Delete ``.partial`` folders and temp files that killed writes left behind."""
    if not root.is_dir():
        return 0
    found = [p for p in root.glob("step-*.partial") if p.is_dir()] + list(root.glob("step-*/.*.tmp"))
    for path in found:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return len(found)


def resume_point(root: Path) -> ResumePoint:
    """The newest step of ``root`` that is complete and readable.

    Raises:
        RunError: the newest complete step is a checkpoint of pipeplan before DCP (with the command that
            converts it).
    """
    removed = _remove_leftovers(root)
    skipped: list[str] = []
    for step in steps_in(root):
        if is_v1(root, step):
            raise RunError(v1_hint(root, step))
        problem = step_problem(root, step)
        if problem:
            skipped.append(f"step-{step}: {problem}")
            continue
        return ResumePoint(step, tuple(skipped), removed)
    return ResumePoint(None, tuple(skipped), removed)


def _pinned(root: Path, step: int, pin_every: int) -> bool:
    return (pin_every > 0 and step % pin_every == 0) or (step_dir(root, step) / PINNED).exists()


def prune(root: Path, keep: int, pin_every: int = 0) -> list[int]:
    """Delete complete steps older than the newest ``keep`` (0: keep all) that are not pinned (a
    multiple of ``pin_every``, or a ``pinned`` file in the folder); returns the steps deleted.
    Folders of another format and incomplete ones stay."""
    if keep <= 0:
        return []
    complete = [s for s in steps_in(root) if not is_v1(root, s) and (step_dir(root, s) / META).is_file()]
    gone = [s for s in complete[keep:] if not _pinned(root, s, pin_every)]
    for step in gone:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
    return gone


def _written(folder: Path) -> list[str]:
    """The files DCP wrote into ``folder``: its ``.metadata`` and the ranks' ``.distcp`` files."""
    return sorted(p.name for p in folder.iterdir() if p.name == ".metadata" or p.suffix == ".distcp")


def publish(root: Path, step: int, meta: dict[str, Any], files: dict[str, Any] | None = None) -> None:
    """After DCP finished writing ``step-N.partial`` (rank 0): ``meta.json`` into it, with each file's
    size and sha256 (``files``: the ranks' own, computed where they were written; the rest, or all
    when None, here), then the folder in place of any older ``step-N`` (a rename: readers see the old
    folder, none, or the new one)."""
    partial, final = root / f"step-{step}.partial", step_dir(root, step)
    files = dict(files or {})
    files.update(safe_read.digests(partial, [n for n in _written(partial) if n not in files]))
    write_json_atomic(partial / META, {**meta, "schema": SCHEMA, "step": step, "files": files})
    if final.exists():
        old = root / f"step-{step}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc``, what it was raised from, and each rank's failure DCP collected in it."""
    found: list[BaseException] = []
    stack = [exc]
    while stack:
        cur = stack.pop()
        if cur in found:
            continue
        found.append(cur)
        stack += [c for c in (cur.__cause__, cur.__context__) if c is not None]
        if isinstance(cur, CheckpointException):
            stack += [pair[0] for pair in cur.failures.values()]
    return found


def state_bytes(state: Any) -> int:
    """The tensor bytes of a (nested) state dict: about what writing it needs on disk."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    return state.numel() * state.element_size() if hasattr(state, "element_size") else 0


def _free_bytes(folder: Path) -> int | None:
    for path in (folder, *folder.parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(path).free
    return None


def write_error(exc: BaseException, root: Path, need: int | None = None) -> Exception:
    """What a failed checkpoint write means: the disk (a RunError naming the file, the bytes this
    rank's share of the step needs and the bytes free), or another rank gone in DCP's collectives
    (:class:`runtime.errors.PeerLost`, so the rank that died is the one blamed)."""
    disk = next(
        (c for c in _causes(exc) if isinstance(c, OSError) and not isinstance(c, ConnectionError)), None
    )
    if disk is not None:
        where = disk.filename or root
        free = _free_bytes(Path(where))
        sizes = [f"this rank's share of the step needs {need:,} bytes" if need else "", ""]
        sizes[1] = f"{free:,} bytes free" if free is not None else ""
        said = "; ".join(x for x in sizes if x)
        return RunError(
            f"writing a checkpoint into {root} failed at {where}: {disk.strerror or disk}"
            + (f" ({said})" if said else "")
            + "; the last complete step stays as it was"
        )
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return PeerLost(f"a checkpoint write failed, another rank is gone or stuck: {first}")


@dataclass
class Saver:
    """Writes a rank's checkpoints (every rank holds one; they save together).

    Attributes:
        root: the checkpoint folder.
        rank: this rank.
        group: the process group DCP plans and agrees over (a gloo group of every rank, apart from the
            training's, so a background write never interleaves with its collectives).
        meta: the run's record for ``meta.json`` (rank 0).
        background: write with ``dcp_async_save``: training goes on once the tensors are copied.
        keep: keep the newest this many steps (0: all), plus pinned ones.
        pin_every: steps that are multiples of this are never deleted (0: none).
        on_saved: called by rank 0 with (step, seconds) once a step is complete on disk.
        pending: the background write in flight, if any.
        blocked_s: seconds training waited for checkpoints, in total.
    """

    root: Path
    rank: int
    group: dist.ProcessGroup | None
    meta: dict[str, Any] = field(default_factory=dict)
    background: bool = False
    keep: int = 0
    pin_every: int = 0
    on_saved: Callable[[int, float], None] | None = None
    pending: Future[Any] | None = None
    blocked_s: float = 0.0
    _worker: ThreadPoolExecutor | None = None
    _need: int = 0

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Write ``state`` (this rank's entries) as ``step``; returns when training may go on. The
        time reported to ``on_saved`` runs from the moment every rank is ready (a barrier: a rank that
        is still stepping its optimizer would otherwise count in another rank's checkpoint time)."""
        self.wait()
        need = self._need = state_bytes(state)
        try:
            partial = self.root / f"step-{step}.partial"
            if self.rank == 0:  # before the barrier: DCP's mkdir on another rank must not race a delete
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True, exist_ok=True)
            if self.group is not None:
                dist.barrier(group=self.group)
            began = time.perf_counter()
            if self.background:
                writer = FileSystemWriter(str(partial))
                started = dcp_async_save(state, storage_writer=writer, process_group=self.group)
                upload = started if isinstance(started, Future) else started.upload_completion
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
                self.pending = self._worker.submit(self._complete, step, began, upload)
            else:
                with warnings.catch_warnings():  # one process without a job (tests, tools): it knows
                    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                    dcp_save(state, storage_writer=FileSystemWriter(str(partial)), process_group=self.group)
                self._complete(step, began)
        except (RuntimeError, OSError, CheckpointException) as exc:
            raise write_error(exc, self.root, need) from exc
        self.blocked_s += time.perf_counter() - began

    def _complete(self, step: int, began: float, upload: Future[Any] | None = None) -> None:
        """After DCP's write (waited for here when it runs in the background): every rank hashes the
        files it wrote, rank 0 gathers the digests, publishes the step and prunes older ones. A rank
        whose write or hashing failed still takes part in the gather (else the others would wait
        out the timeout), and every rank then raises."""
        failure: BaseException | None = None
        mine: dict[str, Any] | str = {}
        try:
            if upload is not None:
                upload.result()
            mine = safe_read.digests(self.root / f"step-{step}.partial", self._own_files(step))
        except (RuntimeError, OSError, CheckpointException) as exc:
            failure, mine = exc, f"rank {self.rank}: {type(exc).__name__}: {exc}"
        found: list[Any] = [mine]
        if self.group is not None:
            found = [None] * dist.get_world_size(self.group) if self.rank == 0 else []
            dist.gather_object(mine, found if self.rank == 0 else None, dst=0, group=self.group)
        if failure is not None:
            raise failure
        if self.rank == 0:
            broken = next((f for f in found if isinstance(f, str)), None)
            if broken is not None:
                raise RunError(f"writing step-{step} into {self.root} failed on {broken}")
            files = {name: d for each in found if isinstance(each, dict) for name, d in each.items()}
            publish(self.root, step, self.meta, files)
            prune(self.root, self.keep, self.pin_every)
            if self.on_saved is not None:
                self.on_saved(step, time.perf_counter() - began)

    def _own_files(self, step: int) -> list[str]:
        """The ``.distcp`` files this rank wrote (DCP names them ``__<rank in the group>_<i>``); all
        of them in one process without a group."""
        partial = self.root / f"step-{step}.partial"
        if self.group is None:
            return [n for n in _written(partial) if n.endswith(".distcp")]
        return sorted(p.name for p in partial.glob(f"__{dist.get_rank(self.group)}_*.distcp"))

    def wait(self) -> None:
        """Wait for a background write (and its publishing); raise its error, if it had one."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        began = time.perf_counter()
        error = pending.exception()
        self.blocked_s += time.perf_counter() - began
        if error is not None:
            raise write_error(error, self.root, self._need) from error

    def close(self) -> None:
        """Wait for the last background write and stop its thread."""
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._worker.shutdown()
                self._worker = None
