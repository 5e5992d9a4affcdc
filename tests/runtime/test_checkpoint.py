"""Checkpoint folders: which step ``--resume`` continues after (complete, readable), leftovers of
killed writes removed, checkpoints before DCP refused with the conversion command, old steps pruned."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from runtime.checkpoints import resume_settings as resume
from runtime.checkpoints import step_folders as checkpoint
from runtime.checkpoints import train_state
from runtime.errors import RunError
from runtime.job.launch import resolve_resume
from runtime.packages.job_config import load_job
from runtime.packages.load import import_package
from runtime.packages.tensor_names import model_names
from runtime.settings.run_options import RunOptions
from tests.runtime.packages import write_package


def save_step(
    root: Path, pkg: Path, step: int, options: RunOptions | None = None, publish: bool = True
) -> None:
    """A complete checkpoint of ``step`` of ``pkg`` (fresh weights, SGD), written in one process as
    the ranks write it together."""
    job = load_job(pkg)
    package = import_package(pkg)
    names = model_names(package, job)
    state: dict[str, object] = {}
    for rank in range(job.world_size):
        k = job.for_rank(rank).stage
        module = package.stage(k)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
        held = [train_state.Held(k, module, optimizer, writes=job.for_rank(rank).replica == 0)]
        state.update(train_state.rank_entries(names, held, rank, step, None, None))
    options = options or RunOptions(str(pkg), steps=10)
    saver = checkpoint.Saver(root, 0, None, resume.record(options, job, options.steps or 10, names))
    if publish:
        saver.save(step, state)
    else:  # killed before rank 0 published it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp_save(state, checkpoint_id=str(root / f"step-{step}.partial"), no_dist=True)


def _overwrite(path: Path, data: bytes) -> None:
    """Bytes in the middle of a file flipped by ``data`` (XOR, none zero), its size kept."""
    body = bytearray(path.read_bytes())
    middle = len(body) // 2
    for i, flip in enumerate(data):
        body[middle + i] ^= flip
    path.write_bytes(bytes(body))


def _unrecord(folder: Path) -> None:
    """``meta.json`` as a run before digests wrote it (no ``files``)."""
    meta = json.loads((folder / "meta.json").read_text())
    del meta["files"]
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.fixture
def pkg(tmp_path: Path) -> Path:
    return write_package(tmp_path / "pkg", "chain", replicas=(1, 1))


def test_newest_complete_step_is_chosen_and_leftovers_are_removed(tmp_path: Path, pkg: Path) -> None:
    root = tmp_path / "ck"
    save_step(root, pkg, 2)
    save_step(root, pkg, 4)
    save_step(root, pkg, 6, publish=False)  # killed before rank 0 renamed it: a .partial folder
    assert (root / "step-6.partial").is_dir() and checkpoint.steps_in(root) == [4, 2]
    assert checkpoint.resume_point(root) == checkpoint.ResumePoint(4, (), 1)
    assert not (root / "step-6.partial").exists()
    assert sorted(p.name for p in (root / "step-4").iterdir()) == [".metadata", "__0_0.distcp", "meta.json"]


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda f: (f / "__0_0.distcp").write_bytes((f / "__0_0.distcp").read_bytes()[:50]), "truncated"),
        (lambda f: (f / "__0_0.distcp").unlink(), "incomplete, no __0_0.distcp"),
        (lambda f: _overwrite(f / ".metadata", b"garbage"), ".metadata is not the file that was written"),
        (lambda f: _overwrite(f / "__0_0.distcp", b"\xff"), "__0_0.distcp is not the file that was written"),
        (lambda f: (_unrecord(f), _overwrite(f / ".metadata", b"garbage")), "unreadable"),
        (lambda f: (f / "meta.json").write_text("[]"), "unreadable"),
        (lambda f: (f / "meta.json").unlink(), "incomplete, no meta.json"),
    ],
    ids=[
        "truncated",
        "missing data",
        "garbage metadata",
        "flipped byte",
        "no digests",
        "meta not a record",
        "no meta",
    ],
)
def test_a_damaged_newest_step_falls_back_to_the_one_before(
    tmp_path: Path, pkg: Path, damage: Callable[[Path], object], why: str
) -> None:
    root = tmp_path / "ck"
    save_step(root, pkg, 2)
    save_step(root, pkg, 4)
    damage(root / "step-4")
    point = checkpoint.resume_point(root)
    assert point.step == 2 and len(point.skipped) == 1
    assert point.skipped[0].startswith("step-4: ") and why in point.skipped[0], point.skipped


def test_a_checkpoint_before_dcp_is_refused_with_the_command_that_converts_it(
    tmp_path: Path, pkg: Path
) -> None:
    root = tmp_path / "ck"
    (root / "step-3").mkdir(parents=True)
    torch.save({"model": {}, "optimizer": {}, "step": 3}, root / "step-3" / "stage0.pt")
    (root / "step-3" / "meta.json").write_text(f'{{"schema": "pipeplan.checkpoint/1", "package": "{pkg}"}}')
    with pytest.raises(
        RunError, match=rf"per-stage checkpoint .* `pipeplan convert-checkpoint {root} --package {pkg}`"
    ):
        checkpoint.resume_point(root)


def test_prune_keeps_the_newest_and_the_pinned(tmp_path: Path, pkg: Path) -> None:
    root = tmp_path / "ck"
    for step in (1, 2, 3, 4, 5, 6):
        save_step(root, pkg, step)
    (root / "step-1" / checkpoint.PINNED).touch()
    assert checkpoint.prune(root, keep=2, pin_every=3) == [4, 2]
    assert checkpoint.steps_in(root) == [6, 5, 3, 1]
    assert checkpoint.prune(root, keep=0) == []


def test_resume_says_where_it_continues_or_that_there_is_nothing(tmp_path: Path, pkg: Path) -> None:
    root = tmp_path / "ck"
    options = RunOptions(str(pkg), steps=10, resume=True, checkpoint_dir=str(root))
    resolved, notes = resolve_resume(options)
    assert resolved.resume_step == 0 and notes == [f"no usable checkpoint in {root}: starting from step 0"]
    save_step(root, pkg, 6)
    resolved, notes = resolve_resume(options)
    assert resolved.resume_step == 6 and notes == [f"resuming after step 6 from {root}/step-6"]


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path, pkg: Path) -> None:
    other = write_package(tmp_path / "other", "skip", replicas=(1, 1, 1))
    root = tmp_path / "ck"
    save_step(root, other, 2)
    options = RunOptions(str(pkg), steps=10, resume=True, checkpoint_dir=str(root))
    with pytest.raises(
        RunError,
        match=r"step-2 holds 'stages.1.fc.weight' of shape \(8, 8\), this package's is \(3, 8\): it was "
        "written for another model",
    ):
        resolve_resume(options)


def test_rank_0_prepares_the_step_folder_before_other_ranks_are_let_into_dcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another rank's DCP creates the folder as soon as the barrier lets it go; a delete by rank 0
    after that raced its mkdir ("File exists")."""
    seen: list[bool] = []

    class Stop(Exception):
        pass

    def barrier(group: object) -> None:
        seen.append((tmp_path / "ck" / "step-2.partial").is_dir())
        raise Stop

    monkeypatch.setattr(checkpoint.dist, "barrier", barrier)
    saver = checkpoint.Saver(tmp_path / "ck", 0, group=object())  # type: ignore[arg-type]
    with pytest.raises(Stop):
        saver.save(2, {})
    assert seen == [True]
