"""``pipeplan verify``: exit 0 on a matching package, 1 on a mismatch, 2 on a folder that is not one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli import main
from partitioner.generation.codegen import write_package
from tests.partitioner.codegen_support import plan_for, profile_for


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("models")
    profile = profile_for("tiny-skip")
    write_package(profile, plan_for(profile, [3, 6]), root / "tiny-skip" / "gpus=3")
    return root


def test_verify_match(models_dir: Path) -> None:
    result = CliRunner().invoke(main, ["verify", str(models_dir / "tiny-skip" / "gpus=3")])
    assert result.exit_code == 0, result.output
    assert "match" in result.output and "rtol=0.0001" in result.output
    assert result.output.count("yes") == 3  # one row per stage
    lines = [line for line in result.output.splitlines() if str(models_dir) not in line]  # (its title)
    assert max(map(len, lines)) <= 80 and "\x1b" not in result.output, result.output


def test_verify_defaults_to_newest_package(models_dir: Path) -> None:
    result = CliRunner().invoke(main, ["verify", "--models-dir", str(models_dir)])
    assert result.exit_code == 0, result.output
    assert "tiny-skip" in result.output


def test_verify_mismatch_exits_1(models_dir: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(models_dir / "tiny-skip" / "gpus=3", tmp_path / "bad"))
    stage2 = folder / "stage2.py"
    stage2.write_text(stage2.read_text().replace("add = l4 + act", "add = l4 - act"))
    result = CliRunner().invoke(main, ["verify", str(folder)])
    assert result.exit_code == 1, result.output
    assert "MISMATCH" in result.output


def test_verify_bad_folder_exits_2(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text("{}")
    result = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert result.exit_code == 2
    assert "missing" in result.output and "__init__.py" in result.output
    result = CliRunner().invoke(main, ["verify", "--models-dir", str(tmp_path / "none")])
    assert result.exit_code == 2
    assert "no package" in result.output
