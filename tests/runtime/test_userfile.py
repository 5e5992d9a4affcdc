"""The one importer of a user's Python file: a missing file, a syntax error, a raising import and a
missing name each give one message naming the file and what to do; a file is imported once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runtime.errors import RunError
from runtime.files.user_code import UserFileError, check_file, file_attr, import_file


@pytest.fixture(autouse=True)
def _restore_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's files join a copy of ``sys.path`` and ``sys.modules``, dropped after it."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_a_missing_file_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(UserFileError, match=r"model file .*nope\.py does not exist; check the path") as err:
        import_file(tmp_path / "nope.py", "model file")
    assert isinstance(err.value, RunError)  # the CLI's one-line error, exit 2
    with pytest.raises(UserFileError, match=r"--data file .*nope\.py does not exist"):
        check_file(tmp_path / "nope.py", "--data file")


def test_a_syntax_error_names_its_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "broken.py", "x = 1\ndef f(:\n    pass\n")
    with pytest.raises(UserFileError, match=r"broken\.py line 2: .*; fix the file"):
        import_file(path)


def test_an_import_that_raises_names_the_exception(tmp_path: Path) -> None:
    path = _write(tmp_path, "raising.py", "raise ValueError('no cheese')\n")
    with pytest.raises(UserFileError, match=r"importing file .*raising\.py raised ValueError: no cheese"):
        import_file(path)
    with pytest.raises(UserFileError, match="raised ValueError"):  # not left half-imported
        import_file(path)


def test_a_missing_name_lists_what_the_file_defines(tmp_path: Path) -> None:
    path = _write(tmp_path, "nets.py", "import math\ndef mlp():\n    return 1\nclass Net:\n    pass\n")
    with pytest.raises(UserFileError, match=r"defines no 'mpl'; it defines Net, mlp; define it or name"):
        file_attr(path, "mpl", "model file")
    assert file_attr(path, "mlp")() == 1


def test_a_file_is_imported_once_and_sees_its_folder(tmp_path: Path) -> None:
    _write(tmp_path, "helper_for_userfile.py", "VALUE = 7\n")
    path = _write(tmp_path, "main.py", "import helper_for_userfile\nVALUE = helper_for_userfile.VALUE\n")
    first = import_file(path)
    assert first.VALUE == 7
    assert import_file(str(path)) is first  # the same module (and classes) for every caller
