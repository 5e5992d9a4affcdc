"""Checkpoint steps changed after they were written, as someone planting code would change them: a
pickle that touches a marker file when it is unpickled, in DCP's ``.metadata`` or in a rank's entry,
with ``meta.json``'s digests recorded again (so only the unpickling can stop it) or left stale."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from runtime.checkpoints import safe_read

__all__ = ["Payload", "flip_byte", "plant_in_entry", "plant_in_metadata", "redigest", "touch"]


def touch(path: str) -> int:
    """What the payload runs: it leaves ``path`` behind."""
    Path(path).touch()
    return 0


class Payload:
    """Unpickled, it calls :func:`touch` on its marker."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (touch, (self.marker,))


def redigest(folder: Path) -> None:
    """Record every file's size and sha256 in ``meta.json`` again, as for the files now there."""
    meta = json.loads((folder / "meta.json").read_text())
    names = sorted(p.name for p in folder.iterdir() if p.name == ".metadata" or p.suffix == ".distcp")
    meta["files"] = safe_read.digests(folder, names)
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))


def plant_in_metadata(folder: Path, marker: Path, digest: bool = True) -> None:
    """The step's own metadata with the payload in it (DCP's reader would run it, then read on)."""
    metadata = safe_read.read_metadata(folder)
    metadata.storage_meta = metadata.storage_meta or StorageMeta()
    metadata.storage_meta.modules = [Payload(marker)]  # type: ignore[list-item]
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    if digest:
        redigest(folder)


def plant_in_entry(folder: Path, marker: Path, key: str = "train_state.step", digest: bool = True) -> None:
    """The step rewritten with ``key`` (a non-tensor entry) replaced by the payload, everything else kept."""
    metadata = safe_read.read_metadata(folder)
    state: dict[str, Any] = {
        k: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        for k, md in metadata.state_dict_metadata.items()
    }
    safe_read.load(state, folder, no_dist=True)
    state[key] = Payload(marker)
    for path in [*folder.glob("*.distcp"), folder / ".metadata"]:
        path.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_save(state, checkpoint_id=str(folder), no_dist=True)
    if digest:
        redigest(folder)


def flip_byte(path: Path) -> None:
    """One byte in the middle of ``path`` inverted, its size kept (a disk's or a copy's damage)."""
    body = bytearray(path.read_bytes())
    body[len(body) // 2] ^= 0xFF
    path.write_bytes(bytes(body))
