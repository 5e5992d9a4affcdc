"""imagefolder:/text: specs become DataLoaders replayed by step; data that cannot fit the model is
refused in one line."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from runtime.datasets.minibatches import make_batches
from runtime.datasets.user_data import DataSettings, check_file_spec, file_spec, output_classes
from runtime.errors import RunError
from runtime.packages.job_config import JobConfig

_TEXT = DataSettings(seq_len=4, sample_shape=(4,), input_dtype="int64", classes=256)


def _text(tmp_path: Path, data: bytes = bytes(range(200))) -> str:
    (tmp_path / "t.txt").write_bytes(data)
    return f"text:{tmp_path / 't.txt'}"


def _job(targets: dict[str, object] | None, inputs: tuple[dict[str, object], ...] = ()) -> JobConfig:
    return JobConfig(Path("pkg"), ((0,),), "1f1b", 1, 4, inputs=inputs, targets=targets)


def test_output_classes_come_from_the_recorded_targets() -> None:
    assert output_classes(_job({"kind": "classes", "high": 10})) == 10
    assert output_classes(_job({"kind": "next_token"}, ({"name": "idx", "high": 97},))) == 97
    assert output_classes(_job({"kind": "normal"})) is None
    assert output_classes(_job(None)) is None


def test_file_specs_are_told_from_module_specs() -> None:
    assert file_spec("text:a/b.txt") == ("text", "a/b.txt")
    assert file_spec("imagefolder:/data/x") == ("imagefolder", "/data/x")
    assert file_spec("mydata:make") is None and file_spec("synthetic") is None


def test_text_batches_are_windows_and_the_same_with_workers_and_on_every_rank(tmp_path: Path) -> None:
    spec = _text(tmp_path)
    batches = make_batches(spec, ModuleType("pkg"), ["input0"], 4, seed=3, shuffle=True, settings=_TEXT)
    assert batches.steps_per_epoch == 199 // 4 // 4
    (x,), y = batches.inputs(2), batches.targets(2)
    assert x.shape == (4, 4) and torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    workers = DataSettings(**{**_TEXT.__dict__, "workers": 1})
    other = make_batches(spec, ModuleType("pkg"), ["input0"], 4, seed=3, shuffle=True, settings=workers)
    for step in (0, 5, 13, 2):  # across epochs, and back
        assert torch.equal(batches.inputs(step)[0], other.inputs(step)[0])
    first = torch.cat([batches.inputs(s)[0] for s in range(12)])
    second = torch.cat([batches.inputs(s)[0] for s in range(12, 24)])
    assert not torch.equal(first, second)  # reshuffled each epoch, each window at most once per epoch
    for epoch in (first, second):
        assert len({tuple(row) for row in epoch.tolist()}) == 48 and bool((epoch[:, 0] % 4 == 0).all())


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path: Path) -> None:
    small = DataSettings(**{**_TEXT.__dict__, "classes": 97})
    with pytest.raises(RunError, match=r"token id 199 .* vocabulary of 97"):
        make_batches(_text(tmp_path), ModuleType("pkg"), ["input0"], 4, 0, False, small)


def test_a_text_shorter_than_a_minibatch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RunError, match=r"3 windows .* fewer than one minibatch of 4"):
        make_batches(_text(tmp_path, b"x" * 13), ModuleType("pkg"), ["input0"], 4, 0, False, _TEXT)


def test_text_needs_a_sequence_length(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="--seq-len"):
        check_file_spec(_text(tmp_path), DataSettings())
    with pytest.raises(RunError, match="no such file"):
        check_file_spec("text:nope.txt", _TEXT)


def test_more_class_folders_than_outputs_are_refused(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        image.new("RGB", (4, 4)).save(tmp_path / name / "0.png")
    settings = DataSettings(sample_shape=(3, 4, 4), classes=2)
    with pytest.raises(RunError, match="3 class folders but the model has 2 outputs"):
        make_batches(f"imagefolder:{tmp_path}", ModuleType("pkg"), ["input0"], 1, 0, False, settings)
