"""The one newest-file finder behind every command's default PACKAGE/--profile."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.errors import RunError
from runtime.files.find_newest import newest, newest_package


def test_newest_is_by_modification_time_and_keeps_only_what_matches(tmp_path: Path) -> None:
    for name, age in (("a", 30), ("b", 10), ("c", 20)):
        path = tmp_path / name / "plan.json"
        path.parent.mkdir()
        path.write_text("{}")
        os.utime(path, (1e9 - age, 1e9 - age))
    assert newest(tmp_path, "*/plan.json", LookupError("none")) == tmp_path / "b" / "plan.json"
    not_b = newest(tmp_path, "*/plan.json", LookupError("none"), lambda p: p.parent.name != "b")
    assert not_b == tmp_path / "c" / "plan.json"


def test_nothing_found_raises_the_callers_error(tmp_path: Path) -> None:
    with pytest.raises(LookupError, match="run `pipeplan partition`"):
        newest(tmp_path / "absent", "**/mp_conf.json", LookupError("run `pipeplan partition`"))


def test_the_newest_package_is_the_newest_folder_with_stage_code(tmp_path: Path) -> None:
    for name, age in (("a", 30), ("b", 20), ("plan-only", 10)):
        folder = tmp_path / name / "gpus=2"
        folder.mkdir(parents=True)
        (folder / "mp_conf.json").write_text("{}")
        if name != "plan-only":  # (a plan made from a PipeDream graph.txt has no stage code)
            (folder / "__init__.py").write_text("")
        os.utime(folder / "mp_conf.json", (1e9 - age, 1e9 - age))
    assert newest_package(tmp_path) == tmp_path / "b" / "gpus=2"
    with pytest.raises(RunError, match="no package under"):
        newest_package(tmp_path / "empty")
