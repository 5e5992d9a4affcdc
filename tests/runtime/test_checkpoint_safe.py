"""Checkpoints are data: a pickle planted in DCP's ``.metadata``, in a rank's entry or in a checkpoint
of pipeplan before DCP never runs, and is refused in the same one line by every reader; a file
changed after it was written skips its step; a full disk leaves the last complete step usable."""

from __future__ import annotations

import ast
import errno
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from runtime.checkpoints import safe_read, train_state
from runtime.checkpoints import step_folders as checkpoint
from runtime.checkpoints.convert_v1 import convert
from runtime.checkpoints.read_tensors import Tensors
from runtime.errors import RunError
from runtime.exporting.model_weights import choose_step
from runtime.files.atomic import write_json_atomic
from runtime.packages.job_config import load_job
from runtime.packages.load import import_package
from runtime.packages.tensor_names import model_names
from tests.runtime.packages import write_package
from tests.runtime.plant import Payload, flip_byte, plant_in_entry, plant_in_metadata
from tests.runtime.test_checkpoint import save_step
from tests.runtime.test_checkpoint_v1 import _write_v1

REFUSED = (
    r"holds a pickled Python object \(GLOBAL tests\.runtime\.plant\.touch\), not tensors and plain values"
)


@pytest.fixture
def pkg(tmp_path: Path) -> Path:
    return write_package(tmp_path / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)


@pytest.fixture
def root(tmp_path: Path, pkg: Path) -> Path:
    root = tmp_path / "ck"
    save_step(root, pkg, 2)
    save_step(root, pkg, 4)
    return root


def _refusals(root: Path) -> list[str]:
    """What resuming and exporting say about the newest step (each must refuse)."""
    lines = []
    for read in (checkpoint.resume_point, choose_step):
        with pytest.raises(safe_read.Refused) as refused:
            read(root)
        lines.append(str(refused.value))
    return lines


def test_a_payload_in_dcp_metadata_never_runs_and_is_refused_in_one_line(root: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    plant_in_metadata(root / "step-4", marker)
    lines = _refusals(root)
    assert lines[0] == lines[1] and "\n" not in lines[0], lines
    assert re.search(rf"step-4/\.metadata: DCP's metadata {REFUSED}", lines[0]), lines[0]
    with pytest.raises(safe_read.Refused):
        Tensors.open(root / "step-4")
    assert not marker.exists()
    FileSystemReader(str(root / "step-4")).read_metadata()  # DCP's own reader: the payload runs
    assert marker.exists()


def test_a_payload_in_a_rank_entry_never_runs_not_even_in_a_rank(
    root: Path, pkg: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    plant_in_entry(root / "step-4", marker)
    lines = _refusals(root)
    assert lines[0] == lines[1] and "\n" not in lines[0], lines
    assert re.search(rf"step-4/__0_0\.distcp: the entry 'train_state\.step' {REFUSED}", lines[0]), lines[0]
    job = load_job(pkg)
    package = import_package(pkg)
    module = package.stage(0)
    held = [train_state.Held(0, module, torch.optim.SGD(module.parameters(), lr=0.01))]
    with pytest.raises(safe_read.Refused, match=REFUSED):  # a rank that loads it anyway
        train_state.load(root / "step-4", model_names(package, job), held, 0, None, None, None, rng=False)
    assert not marker.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_load({"train_state": {"step": 0}}, checkpoint_id=str(root / "step-4"), no_dist=True)
    assert marker.exists()  # DCP's default planner runs it


def test_a_payload_with_stale_digests_is_never_read_the_step_before_is_taken(
    root: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    plant_in_metadata(root / "step-4", marker, digest=False)
    point = checkpoint.resume_point(root)
    assert point.step == 2 and choose_step(root)[0] == 2
    assert point.skipped == (
        "step-4: .metadata is not the file that was written (its sha256 differs from the one meta.json "
        "recorded): changed or damaged since",
    )
    assert not marker.exists()


def test_a_flipped_byte_in_a_shard_skips_the_step(root: Path) -> None:
    flip_byte(root / "step-4" / "__0_0.distcp")
    point = checkpoint.resume_point(root)
    assert point.step == 2 and "step-4: __0_0.distcp is not the file that was written" in point.skipped[0]
    with pytest.raises(RunError, match=r"step-4 cannot be exported: __0_0\.distcp is not the file that was"):
        choose_step(root, 4)


def test_a_payload_in_a_checkpoint_before_dcp_is_refused_by_convert(pkg: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for name in ("stage1.pt", "rank1.pt"):
        root = tmp_path / name
        _write_v1(root, pkg, 2)
        path = root / "step-2" / name
        state = torch.load(path, weights_only=True)
        state["step"] = Payload(marker)
        torch.save(state, path)
        with pytest.raises(safe_read.Refused, match=rf"step-2/{name}: the (stage|rank)'s state {REFUSED}"):
            convert(root, pkg)
        assert checkpoint.is_v1(root, 2) and not (root / "step-2.partial").exists()  # nothing written
    assert not marker.exists()


def _full_after(budget: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP's file streams raise ENOSPC once ``budget`` bytes were written (a disk that fills)."""
    real = FileSystem.create_stream
    left = [budget]

    class Full:
        def __init__(self, stream: Any) -> None:
            self.stream = stream

        def write(self, data: Any) -> int:
            left[0] -= len(memoryview(data).cast("B"))
            if left[0] < 0:
                raise OSError(errno.ENOSPC, "No space left on device", getattr(self.stream, "name", None))
            return int(self.stream.write(data))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.stream, name)

    def create_stream(self: FileSystem, path: Any, mode: str) -> Any:
        from contextlib import contextmanager

        @contextmanager
        def opened() -> Any:
            with real(self, path, mode) as stream:
                yield Full(stream) if "w" in mode else stream

        return opened()

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)


def test_a_full_disk_names_the_file_and_the_bytes_and_the_last_step_stays(
    root: Path, pkg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _full_after(20_000, monkeypatch)
    with pytest.raises(RunError) as failed:
        save_step(root, pkg, 6)
    line = str(failed.value)
    assert "\n" not in line and "No space left on device" in line, line
    assert re.search(r"failed at \S+step-6\.partial/__0_0\.distcp: .*needs [\d,]+ bytes", line), line
    monkeypatch.undo()
    assert checkpoint.steps_in(root) == [4, 2]  # nothing half-written published
    assert checkpoint.resume_point(root) == checkpoint.ResumePoint(4, (), 1)  # the torn write removed


def test_metrics_on_a_full_disk_leave_no_half_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "metrics.json"
    write_json_atomic(path, {"steps": 1})

    def full(self: Path, text: str, encoding: str | None = None) -> int:
        with open(self, "w") as half:
            half.write(text[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(RunError, match=rf"cannot write {path}: No space left on device \(it needs 16 bytes"):
        write_json_atomic(path, {"steps": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"steps": 1} and sorted(p.name for p in tmp_path.iterdir()) == [
        "metrics.json"
    ]


def test_the_runtime_reads_checkpoints_only_through_the_safe_reader() -> None:
    """No module but runtime/checkpoints/safe_read.py calls DCP's loader or reader; every torch.load is
    weights_only."""
    loads = 0
    for path in sorted((Path(__file__).resolve().parents[2] / "runtime").rglob("*.py")):
        text = path.read_text()
        if path.name != "safe_read.py":
            assert "state_dict_loader" not in text and "FileSystemReader" not in text, path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                loads += 1
                flags = {k.arg: ast.unparse(k.value) for k in node.keywords}
                assert flags.get("weights_only") == "True", (path, node.lineno)
    assert loads
