"""Checkpoints are data, end to end: a pickle planted in a step never runs and `run --resume`,
`export` and `convert-checkpoint` refuse it in the same one line; a flipped byte in a shard is found
on resume and the step before resumes bit for bit; a disk that fills during a run stops it in one
line, and its last complete step resumes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from cli import main
from runtime.checkpoints import safe_read
from tests.runtime.packages import write_package
from tests.runtime.plant import Payload, flip_byte, plant_in_entry, plant_in_metadata
from tests.runtime.test_checkpoint_v1 import _write_v1

pytestmark = pytest.mark.slow
TIMEOUT = ["--timeout", "30"]


def _cli(*args: Any) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """4 steps on 2 gloo ranks, checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("safety")
    pkg = write_package(root / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)
    code, out = _cli(
        "run", pkg, "--steps", 4, "--checkpoint-every", 2, "--checkpoint-dir", root / "ck", *TIMEOUT
    )
    assert code == 0, out
    return pkg, root / "ck"


def _everything(folder: Path) -> dict[str, Any]:
    """Every entry of a step: weights, optimizer state, generators, schedule, step."""
    metadata = safe_read.read_metadata(folder)
    state: dict[str, Any] = {
        k: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        for k, md in metadata.state_dict_metadata.items()
    }
    safe_read.load(state, folder, no_dist=True)
    return state


def test_a_flipped_byte_is_found_and_the_step_before_resumes_bit_exactly(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    pkg, ck = trained
    damaged = tmp_path / "ck"
    shutil.copytree(ck, damaged)
    flip_byte(damaged / "step-4" / "__1_0.distcp")
    code, out = _cli("run", pkg, "--steps", 4, "--resume", "--checkpoint-dir", damaged, *TIMEOUT)
    assert code == 0, out
    skipped = [line for line in out.splitlines() if line.startswith("skipped")]
    assert skipped == [
        f"skipped {damaged}/step-4: __1_0.distcp is not the file that was written (its sha256 differs from "
        "the one meta.json recorded): changed or damaged since"
    ], out
    assert f"resuming after step 2 from {damaged}/step-2" in out
    want, got = _everything(ck / "step-4"), _everything(damaged / "step-4")
    assert sorted(want) == sorted(got)
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key


def test_a_planted_pickle_never_runs_and_every_command_refuses_it_in_one_line(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    pkg, ck = trained
    marker = tmp_path / "ran"
    for plant, file in ((plant_in_metadata, ".metadata"), (plant_in_entry, "__0_0.distcp")):
        planted = tmp_path / plant.__name__
        shutil.copytree(ck, planted)
        plant(planted / "step-4", marker)
        lines = [
            _cli("run", pkg, "--steps", 6, "--resume", "--checkpoint-dir", planted, *TIMEOUT),
            _cli("export", pkg, "--checkpoint-dir", planted, "-o", tmp_path / "m.pt"),
            _cli("export", pkg, "--checkpoint-dir", planted, "--step", 4, "-o", tmp_path / "m.safetensors"),
        ]
        for code, out in lines:
            assert code == 2 and out.count("\n") == 1 and out == lines[0][1], out
        assert out.startswith(f"error: {planted}/step-4/{file}: ") and "holds a pickled Python object" in out
        assert not (tmp_path / "m.pt").exists() and not (tmp_path / "m.safetensors").exists()
    old = tmp_path / "v1"
    _write_v1(old, pkg, 2)
    state = torch.load(old / "step-2" / "stage0.pt", weights_only=True)
    torch.save({**state, "step": Payload(marker)}, old / "step-2" / "stage0.pt")
    code, out = _cli("convert-checkpoint", old, "--package", pkg)
    assert code == 2 and out.count("\n") == 1, out
    assert out.startswith(f"error: {old}/step-2/stage0.pt: the stage's state holds a pickled Python object")
    assert out.split("), ")[1] == lines[0][1].split("), ")[1]  # the same reason and advice
    assert not marker.exists()


def test_a_full_disk_stops_the_run_in_one_line_and_its_last_step_resumes(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    pkg, _ = trained
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1100k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (root only); the ENOSPC tests in tests/runtime cover it")
    try:
        code, out = _cli(
            "run", pkg, "--steps", 60, "--checkpoint-every", 1, "--checkpoint-dir", disk / "ck", *TIMEOUT
        )
        shutil.copytree(disk / "ck", tmp_path / "ck")
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, out
    assert f"error: training stopped: the disk holding {disk}/ck is full" in lines[0]
    assert "a checkpoint step needs about" in lines[0] and "bytes (step-" in lines[0], lines[0]
    last = int(lines[0].split("continues from step-")[1].split(",")[0])
    code, out = _cli(
        "run", pkg, "--steps", last + 1, "--resume", "--checkpoint-dir", tmp_path / "ck", *TIMEOUT
    )
    assert code == 0, out
    assert f"resuming after step {last} from {tmp_path}/ck/step-{last}" in out
