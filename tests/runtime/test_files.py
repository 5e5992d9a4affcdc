"""runtime.files.atomic and runtime.files.read_json: the library's one writer and one JSON reader."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from runtime.errors import RunError
from runtime.files.atomic import WriteError, write_atomic, write_json_atomic, write_text_atomic
from runtime.files.read_json import JsonReadError, read_json


def test_a_write_replaces_the_file_whole_with_the_mode_open_gives(tmp_path: Path) -> None:
    path = write_json_atomic(tmp_path / "new" / "doc.json", {"a": [1, 2]})
    assert path.read_text() == '{\n "a": [\n  1,\n  2\n ]\n}\n'
    mask = os.umask(0o022)
    try:
        write_text_atomic(path, "x")
    finally:
        os.umask(mask)
    assert path.read_text() == "x" and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["doc.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = write_text_atomic(tmp_path / "doc.txt", "old")

    def half(tmp: Path) -> None:
        tmp.write_text("ha")
        raise ValueError("stopped")

    with pytest.raises(ValueError, match="stopped"):
        write_atomic(path, half)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["doc.txt"]
    (tmp_path / "file").write_text("")
    with pytest.raises(WriteError, match=r"cannot write .*file/doc\.txt") as caught:
        write_text_atomic(tmp_path / "file" / "doc.txt", "x")
    assert isinstance(caught.value, RunError)


def test_read_json_says_why_in_one_typed_error(tmp_path: Path) -> None:
    assert read_json(write_json_atomic(tmp_path / "ok.json", [1])) == [1]
    with pytest.raises(JsonReadError, match=r"the trace .*absent\.json: it does not exist") as gone:
        read_json(tmp_path / "absent.json", "the trace")
    assert gone.value.missing
    with pytest.raises(JsonReadError, match="is missing; write it") as named:
        read_json(tmp_path / "absent.json", missing=f"{tmp_path / 'absent.json'} is missing; write it")
    assert named.value.missing
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(JsonReadError, match=r"cannot read .*bad\.json: Expecting") as bad:
        read_json(tmp_path / "bad.json")
    assert not bad.value.missing
