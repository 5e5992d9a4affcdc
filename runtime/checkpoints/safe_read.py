"""Reading a checkpoint as data: nothing in a checkpoint folder can make pipeplan run code.

torch.distributed.checkpoint (DCP) unpickles a step's ``.metadata`` with plain :func:`pickle.load`
and every non-tensor entry of a rank's ``.distcp`` file with ``torch.load(weights_only=False)``, so a
planted pickle would run on ``--resume`` or ``export``. Here DCP is used through two of its own
extension points instead:

- :class:`SafeReader`, a :class:`FileSystemReader` whose ``.metadata`` goes through an unpickler that
  admits only the classes DCP's metadata is made of (found by writing one and reading it with
  ``pickletools``: :data:`_ADMITTED`), and whose storage paths must name files inside the step folder;
- :class:`WeightsOnlyPlanner`, a :class:`DefaultLoadPlanner` that loads non-tensor entries with
  ``torch.load(weights_only=True)`` (tensors DCP already loads so).

A checkpoint that holds anything else is refused with :class:`Refused`, one line naming the file
and the Python object it names, the same line whichever command read it. :func:`file_digest` is
the sha256 each step's ``meta.json`` records per file (:mod:`runtime.checkpoints.step_folders`
writes and checks them), so a file changed after it was written is found before it is read.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from runtime.errors import RunError

__all__ = [
    "Refused",
    "SafeReader",
    "WeightsOnlyPlanner",
    "check_values",
    "digests",
    "file_digest",
    "load",
    "load_weights_only",
    "read_metadata",
    "refusal",
]

_ADMITTED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by its name (torch.strided)
    "torch": frozenset({"Size"}),  # and the dtypes, below
    "pathlib": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),  # the id
    "pathlib._local": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),  # 3.13
}
"""What DCP's ``.metadata`` pickles (torch 2.13): its metadata dataclasses, torch.Size, dtypes, a
layout by name, and the checkpoint id as a path. None of them runs code when rebuilt."""


class Refused(RunError):
    """A checkpoint file holds a Python object that is not data: it was changed after pipeplan wrote it."""


def refusal(path: Path, what: str, found: str) -> Refused:
    """The one line every command gives for a checkpoint file that names ``found`` (a Python object)."""
    return Refused(
        f"{path}: {what} holds a pickled Python object ({found}), not tensors and plain values; "
        "pipeplan runs no code from a checkpoint and refuses it (a checkpoint it wrote holds none, so "
        "this file was changed after it was written): delete it or use another checkpoint folder"
    )


def _named(exc: BaseException) -> str:
    """What a refused unpickling named: ``GLOBAL module.name``, else its reason's first line."""
    text = str(exc)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return f"GLOBAL {found[1]}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = next((line for line in lines if line.startswith("Unsupported")), lines[-1] if lines else "")
    return reason or type(exc).__name__


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's metadata and nothing else: any other global is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ADMITTED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def read_metadata(folder: Path) -> Metadata:
    """``folder/.metadata`` through :class:`_MetadataUnpickler`, its storage paths checked.

    Raises:
        Refused: it names a Python object DCP's metadata never holds, or a file outside ``folder``.
        OSError, pickle.UnpicklingError, EOFError, ValueError: it is missing or damaged.
    """
    path = folder / ".metadata"
    with open(path, "rb") as stream:
        try:
            metadata = _MetadataUnpickler(stream).load()
        except pickle.UnpicklingError as exc:
            if str(exc).startswith("GLOBAL "):
                raise refusal(path, "DCP's metadata", str(exc)) from None
            raise
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise Refused(f"{path}: DCP's metadata points at {name!r}, outside {folder}; refused")
    return metadata


def load_weights_only(source: Path | io.BytesIO, path: Path, what: str, **kwargs: Any) -> Any:
    """``torch.load(weights_only=True)``, a refused object as :func:`refusal`'s one line.

    Raises:
        Refused: the file holds a Python object that is not a tensor or a plain value.
    """
    try:
        with warnings.catch_warnings():  # "pickle protocol 4": DCP writes its values so
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            return torch.load(source, map_location="cpu", weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        raise refusal(path, what, _named(exc)) from None


class SafeReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata` (read once, kept) and :class:`WeightsOnlyPlanner`
    required for its data."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.folder = Path(path)
        self._metadata: Metadata | None = None

    def read_metadata(self) -> Metadata:  # (no ``rank=``: DCP then tries no rank-local fallback)
        if self._metadata is None:
            metadata = read_metadata(self.folder)
            storage = metadata.storage_meta or StorageMeta()  # (as DCP's read_metadata does)
            storage.load_id = self.load_id
            metadata.storage_meta, self._metadata = storage, metadata
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        if not isinstance(planner, WeightsOnlyPlanner):
            raise TypeError("SafeReader reads with a WeightsOnlyPlanner only")
        planner.files = {
            i.storage_index: self.storage_data[i.storage_index].relative_path for i in plan.items
        }
        return super().read_data(plan, planner)


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor entries loaded ``weights_only``."""

    def __init__(self, folder: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.folder = folder
        self.files: dict[Any, str] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        where = self.folder / self.files.get(read_item.storage_index, "?")
        obj = load_weights_only(value, where, f"the entry {fqn!r}")
        if self.flatten_state_dict:  # (as DefaultLoadPlanner.load_bytes puts it)
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _refused_in(exc: BaseException) -> Refused | None:
    """The :class:`Refused` behind ``exc``, also from inside DCP's per-rank failures."""
    stack, seen = [exc], set()
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, Refused):
            return cur
        stack += [c for c in (cur.__cause__, cur.__context__) if c is not None]
        if isinstance(cur, CheckpointException):
            stack += [pair[0] for pair in cur.failures.values()]
    return None


def load(
    state_dict: dict[str, Any], folder: Path, group: dist.ProcessGroup | None = None, no_dist: bool = False
) -> None:
    """DCP's load of ``state_dict`` from ``folder`` (in place), through :class:`SafeReader` and
    :class:`WeightsOnlyPlanner`; every rank of ``group`` calls it together, or one process with
    ``no_dist``.

    Raises:
        Refused: the step holds a Python object that is not data (before DCP reads any tensor, when
            it is in ``.metadata``).
    """
    reader = SafeReader(folder)
    reader.read_metadata()
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", ".*in a single process", UserWarning)
            dcp_load(
                state_dict,
                storage_reader=reader,
                planner=WeightsOnlyPlanner(folder),
                process_group=group,
                no_dist=no_dist,
            )
    except (Exception, CheckpointException) as exc:  # (DCP's is a BaseException)
        refused = _refused_in(exc)
        if refused is not None:
            raise Refused(str(refused)) from exc
        raise


def check_values(folder: Path) -> None:
    """Load every non-tensor entry of the step (small: steps, settings, the schedule's state), so a
    refused one is found in one process, before any rank starts.

    Raises:
        Refused: an entry holds a Python object that is not data.
    """
    metadata = read_metadata(folder)
    keys = [k for k, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)]
    if keys:
        load(dict.fromkeys(keys), folder, no_dist=True)


def file_digest(path: Path) -> str:
    """The sha256 of a file, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def digests(folder: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Per file of ``folder`` named: its size and sha256, as ``meta.json`` records them."""
    return {n: {"bytes": (folder / n).stat().st_size, "sha256": file_digest(folder / n)} for n in names}
