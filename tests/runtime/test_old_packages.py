"""A package generated before the runtime had sub-packages still imports, verifies and trains.

``tests/golden/cf5b433-tiny-skip-gpus2.zip`` holds such a package's folder ``gpus=2/``, written by
pipeplan at commit cf5b433 (``pipeplan profile tiny-skip --batch-size 2`` then ``pipeplan partition
--gpus 2 --cuts act --replicas 1,1 --schedule 1f1b``). Its copy of the stage kit imports the runtime
by the old flat names, which :data:`runtime.MOVED` keeps importable. (Zipped: as plain files, its
``_stagekit.py``, identical to the old ``runtime/stagekit.py``, would be taken by git for that
file's new place when branches merge across the move.)"""

from __future__ import annotations

import ast
import importlib
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import runtime
from cli import main
from runtime.packages.load import import_package

ZIPPED = Path(__file__).parents[1] / "golden" / "cf5b433-tiny-skip-gpus2.zip"
ROOT = Path(__file__).parents[2]


@pytest.fixture
def old(tmp_path: Path) -> Path:
    """The old package, unpacked into a folder of its own."""
    with zipfile.ZipFile(ZIPPED) as archive:
        archive.extractall(tmp_path)
    return tmp_path / "gpus=2"


def _runtime_imports(path: Path) -> set[str]:
    """The ``runtime.*`` modules a file imports, by the names it writes."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("runtime."):
            names.add(node.module or "")
    return names


def test_every_old_name_is_the_module_that_holds_its_code_now() -> None:
    for old, new in runtime.MOVED.items():
        assert (ROOT / "runtime" / (new.replace(".", "/") + ".py")).is_file(), new
        assert not (ROOT / "runtime" / f"{old}.py").exists(), f"runtime/{old}.py is back: drop it from MOVED"
        assert importlib.import_module(f"runtime.{old}") is importlib.import_module(f"runtime.{new}")


def test_the_old_stage_kit_imports_old_names_and_each_resolves(old: Path) -> None:
    imported = _runtime_imports(old / "_stagekit.py")
    flat = {name for name in imported if name.removeprefix("runtime.") in runtime.MOVED}
    assert {"runtime.weights", "runtime.userfile", "runtime.deferred_init"} <= flat  # (as it was written)
    for name in imported:
        assert sys.modules.get(name) or importlib.import_module(name)


def test_an_old_package_builds_each_stage_as_its_full_model_does(old: Path) -> None:
    package = import_package(old)
    full = dict(package.full_model(seed=3).named_parameters())
    for k in range(2):
        for name, param in package.stage(k, seed=3).named_parameters():
            assert torch.equal(param, full[name]), (k, name)


@pytest.mark.slow
def test_an_old_package_verifies_and_trains(old: Path) -> None:
    folder = old
    result = CliRunner().invoke(main, ["verify", str(folder)])
    assert result.exit_code == 0 and "match" in result.output, result.output
    result = CliRunner().invoke(main, ["run", str(folder), "--steps", "2", "--timeout", "60"])
    assert result.exit_code == 0, result.output
    assert (folder / "run" / "metrics.json").is_file()
