"""A folder per run: new runs never share a folder, ``run`` links to the newest, ``--resume``
continues the newest, an older package's real ``run/`` stays readable, a refused run leaves nothing."""

from __future__ import annotations

import os
from pathlib import Path

from runtime.job.run_folders import begin, discard_if_empty, latest, publish, run_folder
from runtime.settings.run_options import RunOptions
from runtime.settings.run_toml import to_toml


def _start(package: Path, **fields: object) -> RunOptions:
    options = begin(RunOptions(package=str(package), **fields), checkpoints=True)  # type: ignore[arg-type]
    (Path(options.run_dir or "") / "metrics.json").write_text(options.run_dir or "")
    publish(options)
    return options


def test_each_run_gets_its_own_folder_and_run_links_to_the_newest(tmp_path: Path) -> None:
    first, second = _start(tmp_path), _start(tmp_path)
    assert first.run_dir != second.run_dir
    assert Path(first.run_dir or "").parent == Path(second.run_dir or "").parent == tmp_path / "runs"
    assert (tmp_path / "run").is_symlink() and not os.readlink(tmp_path / "run").startswith("/")
    assert latest(tmp_path) == Path(second.run_dir or "").resolve()
    assert (tmp_path / "run" / "metrics.json").read_text() == second.run_dir  # the old path: the newest
    assert (Path(first.run_dir or "") / "metrics.json").read_text() == first.run_dir  # kept
    assert second.checkpoint_dir == str(Path(second.run_dir or "") / "checkpoints")
    assert run_folder(tmp_path, first.run_dir) == Path(first.run_dir or "")  # an explicit older run


def test_resume_continues_the_newest_run_and_run_dir_names_one(tmp_path: Path) -> None:
    first = _start(tmp_path)
    resumed = begin(RunOptions(package=str(tmp_path), resume=True), checkpoints=True)
    assert Path(resumed.run_dir or "") == Path(first.run_dir or "").resolve()
    named = begin(RunOptions(package=str(tmp_path), run_dir=str(tmp_path / "mine")), checkpoints=False)
    assert named.run_dir == str(tmp_path / "mine") and named.checkpoint_dir is None
    publish(named)  # a folder outside runs/ is not linked
    assert latest(tmp_path) == Path(first.run_dir or "").resolve()


def test_an_older_packages_run_folder_moves_under_runs_and_stays_the_newest(tmp_path: Path) -> None:
    (tmp_path / "run" / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "run" / "metrics.json").write_text("old")
    assert latest(tmp_path) == tmp_path / "run"  # readable where it is until the next run
    resumed = begin(RunOptions(package=str(tmp_path), resume=True), checkpoints=True)
    assert (tmp_path / "run").is_symlink() and (tmp_path / "run" / "metrics.json").read_text() == "old"
    assert Path(resumed.checkpoint_dir or "", "step-2").is_dir()  # --resume finds its checkpoints
    fresh = _start(tmp_path)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(
        [Path(resumed.run_dir or "").name, Path(fresh.run_dir or "").name]
    )


def test_a_refused_run_leaves_no_folder_and_the_link_unchanged(tmp_path: Path) -> None:
    first = _start(tmp_path)
    refused = begin(RunOptions(package=str(tmp_path)), checkpoints=True)
    (Path(refused.checkpoint_dir or "")).mkdir()  # the checks create the folders, no file
    discard_if_empty(refused)
    assert (
        not Path(refused.run_dir or "").exists() and latest(tmp_path) == Path(first.run_dir or "").resolve()
    )
    discard_if_empty(first)
    assert Path(first.run_dir or "").is_dir()  # a run that wrote something stays


def test_run_toml_repeats_the_run_in_a_new_folder(tmp_path: Path) -> None:
    options = begin(RunOptions(package=str(tmp_path), steps=3), checkpoints=True, create=False)
    text = to_toml(options)
    assert "steps = 3" in text and "run-dir" not in text and "checkpoint-dir" not in text
    elsewhere = RunOptions(package=str(tmp_path), run_dir=options.run_dir, checkpoint_dir=str(tmp_path / "c"))
    assert "checkpoint-dir" in to_toml(elsewhere)  # a folder the user chose is part of the run


def test_multi_node_jobs_agree_on_their_folder_without_talking(tmp_path: Path) -> None:
    nodes = [
        begin(
            RunOptions(package=str(tmp_path), nnodes=2, node_rank=r, master_port=29500), False, create=False
        )
        for r in (0, 1)
    ]
    assert nodes[0].run_dir == nodes[1].run_dir == str(tmp_path / "runs" / "nodes-29500")
