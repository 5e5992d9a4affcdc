"""A profile request is checked before anything is measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from partitioner.errors import PipeplanError
from partitioner.profiler.request import check_estimate_options, check_output, parse_shape, prepare


def test_parse_shape() -> None:
    assert parse_shape("3,224,224") == parse_shape("3x224x224") == (3, 224, 224)
    assert parse_shape(None) is None
    for bad in ("", "3,-1", "a,b", "0"):
        with pytest.raises(PipeplanError, match="bad --input-shape"):
            parse_shape(bad)


def test_the_output_must_be_a_writable_file_that_is_not_someone_elses(tmp_path: Path) -> None:
    with pytest.raises(PipeplanError, match="is a folder"):
        check_output(tmp_path)
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": true}')
    with pytest.raises(PipeplanError, match="refusing to overwrite"):
        check_output(foreign)
    check_output(tmp_path / "new" / "profile.json")  # (its folder is made)
    assert (tmp_path / "new").is_dir()


def test_an_estimate_refuses_options_that_shape_a_measurement() -> None:
    check_estimate_options("cpu", ["threads", "batch_size"])  # the cpu model measures at --threads
    with pytest.raises(PipeplanError, match="--repeats shapes a measurement"):
        check_estimate_options("cpu", ["repeats"])


def test_prepare_names_the_default_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    shape, path = prepare("tiny-mlp", None, 4, "16", "float32", "fp32", None)
    assert shape == (16,) and path == Path("profiles") / "tiny-mlp" / "profile.json"
    with pytest.raises(PipeplanError, match="--batch-size must be positive"):
        prepare("tiny-mlp", None, 0, None, "float32", "fp32", None)
