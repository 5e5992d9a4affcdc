"""verify_package: the generated stage chain against the unsplit model, on the models the issue names."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from partitioner.errors import PackageError
from partitioner.generation.codegen import write_package
from partitioner.verification.verify import verify_package
from tests.partitioner.codegen_support import HF_GPT2, plan_for, profile_for


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _package(tmp: Path, spec: str, cuts: list[int], shape: tuple[int, ...] | None = None, **kw: str) -> Path:
    profile = profile_for(spec, 2, shape)
    out = tmp / "gpus"
    write_package(profile, plan_for(profile, cuts), out, **kw)  # type: ignore[arg-type]
    return out


def _assert_match(folder: Path, stages: int) -> None:
    report = verify_package(folder)
    assert report.ok, report
    assert len(report.stages) == stages
    assert all(s.init_error == 0.0 for s in report.stages)
    assert report.loss > 0 and report.loss_error <= 1e-5


def test_vgg16_small_input(tmp_path: Path) -> None:
    _assert_match(_package(tmp_path, "vgg16", [10, 20, 33], (3, 32, 32), init="seeded"), 4)


def test_resnet50_cut_inside_residual_blocks(tmp_path: Path) -> None:
    """Cuts after layer1.0's first conv and inside layer1.1: the block inputs cross as skip tensors."""
    folder = _package(tmp_path, "resnet50", [9, 20, 60], (3, 32, 32), init="seeded")
    report = verify_package(folder)
    assert report.ok, report
    assert report.stages[1].in_names == ("layer1_0_downsample_1", "layer1_0_bn1")
    assert len(report.stages[1].out_names) == 2  # a block's output and a tensor inside the next block


def test_gpt_tied_embeddings_in_four_stages(tmp_path: Path) -> None:
    folder = _package(tmp_path, "tiny-gpt", [4, 12, 24])
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["ties"][0]["members"] == [[0, "wte.weight"], [3, "lm_head.weight"]]
    _assert_match(folder, 4)


def test_skip_tensor_across_two_boundaries(tmp_path: Path) -> None:
    folder = _package(tmp_path, "tiny-skip", [3, 6])
    report = verify_package(folder)
    assert report.ok
    assert "act" in report.stages[0].out_names and "act" in report.stages[2].in_names


@pytest.mark.parametrize("cuts", [[8], [3, 8, 10]], ids=["2-stages", "4-stages"])
def test_hugging_face_gpt2_through_torch_export(tmp_path: Path, cuts: list[int]) -> None:
    profile = profile_for(HF_GPT2)
    assert profile.tracer == "export"
    write_package(profile, plan_for(profile, cuts), tmp_path / "pkg")
    _assert_match(tmp_path / "pkg", len(cuts) + 1)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("verify") / "gpus=2"
    profile = profile_for("tiny-cnn")
    write_package(profile, plan_for(profile, [5]), folder)
    return folder


def _copy(good: Path, tmp: Path) -> Path:
    return Path(shutil.copytree(good, tmp / "copy"))


def test_a_wrong_stage_is_caught(good: Path, tmp_path: Path) -> None:
    """Change one op in stage 1's generated forward: verify must report a mismatch, not pass."""
    folder = _copy(good, tmp_path)
    stage1 = folder / "stage1.py"
    text = stage1.read_text()
    assert "self.relu_a(" in text
    stage1.write_text(text.replace("self.relu_a(", "torch.sigmoid(", 1))
    report = verify_package(folder)
    assert not report.ok
    assert report.output_error > 1e-3
    assert not report.stages[0].ok  # its gradients change too


@pytest.mark.parametrize("missing", ["mp_conf.json", "stage1.py", "__init__.py"])
def test_missing_files(good: Path, tmp_path: Path, missing: str) -> None:
    folder = _copy(good, tmp_path)
    (folder / missing).unlink()
    with pytest.raises(PackageError, match=missing.replace(".", r"\.")):
        verify_package(folder)


def test_mp_conf_not_matching_model(good: Path, tmp_path: Path) -> None:
    folder = _copy(good, tmp_path)
    (folder / "mp_conf.json").write_text(
        json.dumps({"module_to_stage_map": [0, 1], "stage_to_rank_map": {"0": [0]}})
    )
    with pytest.raises(PackageError, match="module_to_stage_map"):
        verify_package(folder)


def test_plan_for_another_model(good: Path, tmp_path: Path) -> None:
    folder = _copy(good, tmp_path)
    plan = json.loads((folder / "plan.json").read_text())
    plan["model"] = "vgg16"
    (folder / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(PackageError, match="for model 'vgg16'"):
        verify_package(folder)


def test_progress_names_each_phase_as_it_starts(good: Path) -> None:
    """verify says what it is doing (the CLI shows it: a large model's check takes minutes)."""
    seen: list[tuple[str, int, int]] = []
    assert verify_package(good, progress=lambda *step: seen.append(step)).ok
    assert [(what.split(" ")[0], done, total) for what, done, total in seen] == [
        ("forward", 0, 2),
        ("checking", 0, 2),
        ("checking", 1, 2),
    ]
    assert seen[1][0].startswith("checking stage 1's gradients")


def test_exported_graph_is_traced_at_the_microbatch_size(tmp_path: Path) -> None:
    """An export with static shapes runs at one batch size only: the one each stage sees per microbatch."""
    profile = profile_for(HF_GPT2)
    plan = replace(plan_for(profile, [8]), batch_size=6, microbatches=3)
    final = write_package(profile, plan, tmp_path / "pkg")
    static = final.extra["static_batch_size"]
    assert static == (2 if profile.tracer_options.get("static_shapes") else None)
    report = verify_package(tmp_path / "pkg")
    assert report.ok and report.batch_size == (static or 6)


def test_exported_stages_follow_their_inputs_device(tmp_path: Path) -> None:
    """torch.export bakes ``device=cpu`` into aranges and casts; a stage on a GPU rank would then mix
    devices. The generated code reads the device from the stage's first input instead."""
    profile = profile_for(HF_GPT2)
    write_package(profile, plan_for(profile, [3, 8, 10]), tmp_path / "pkg")
    code = {p.name: p.read_text() for p in (tmp_path / "pkg").glob("stage*.py")}
    assert not [
        name for name, text in code.items() if "device(type=" in text or "from torch import device" in text
    ]
    baked = [text for text in code.values() if "device = input_device" in text]
    assert baked and all(re.search(r"input_device = \w+\.device", text) for text in baked)
    assert verify_package(tmp_path / "pkg").ok


def test_stage_writing_its_input_in_place(tmp_path: Path) -> None:
    """Cuts right before ReLU(inplace=True) and before .relu_(): on a rank the received tensor is an
    autograd leaf, so the stage must write into a copy; verify runs stages on leaves, as ranks do."""
    folder = _package(tmp_path, "tests/partitioner/codegen_models.py:in_place", [2, 5])
    _assert_match(folder, 3)
    for k, name in ((1, "l1"), (2, "add")):
        assert f"{name}_copy = {name}.clone()" in (folder / f"stage{k}.py").read_text()
    assert "clone" not in (folder / "stage0.py").read_text()


@pytest.mark.slow
def test_verify_holds_a_stage_not_the_model(tmp_path: Path) -> None:
    """24 layers of 16 MiB in 8 stages: verify's memory grows by a stage's weights and gradients, the
    original's gradient of one layer as it arrives and one layer being read: less than half the
    384 MiB model (a whole-model check holds four copies of it)."""
    spec = f"{Path(__file__).with_name('wide_model.py')}:wide"
    profile = profile_for(spec, 2)
    assert [n.op for n in profile.nodes[:2]] == ["input", "call_module"]
    write_package(profile, plan_for(profile, list(range(4, 25, 3))), tmp_path / "pkg", init="seeded")
    code = textwrap.dedent(
        f"""
        import torch
        from pathlib import Path
        from partitioner.verification.verify import load_package, verify_package
        from runtime.observing.resident_memory import (
            map_large_blocks, peak_resident_bytes, reset_peak, resident_bytes,
        )

        torch.set_num_threads(1)
        map_large_blocks()
        load_package(Path({str(tmp_path / "pkg")!r}))  # imports, so only what verify holds is counted
        reset_peak()
        before = resident_bytes()
        report = verify_package(Path({str(tmp_path / "pkg")!r}))
        print(int(report.ok), (peak_resident_bytes() - before) // 1024)
        """
    )
    hop = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {code!r}]))"
    result = subprocess.run([sys.executable, "-c", hop], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    ok, grown_kib = map(int, result.stdout.split())
    assert ok
    assert grown_kib < 192 * 1024, f"verify grew by {grown_kib / 1024:.0f} MiB for a 384 MiB model"


@pytest.mark.parametrize("init", ["seeded", "exact"])
def test_weights_read_through_an_attribute_view(tmp_path: Path, init: str) -> None:
    """``x @ self.weight.T`` on the original model, built without its weights (deferred under the
    exact init): the view is taken on the weight's shape and its values are made when the product
    reads them."""
    spec = f"{Path(__file__).with_name('transposed_model.py')}:transposed"
    profile = profile_for(spec, 2)
    write_package(profile, plan_for(profile, [3]), tmp_path / "pkg", init=init)
    _assert_match(tmp_path / "pkg", 2)
