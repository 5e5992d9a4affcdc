"""`pipeplan export`: a run's stage checkpoints merged into one state_dict that the original model loads
strictly and that computes what the trained stages compute; Hugging Face models round-trip through
save_pretrained and from_pretrained; missing, incomplete and absent steps are refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from cli import main
from runtime.building.stage_init import factory_from_spec
from runtime.packages.load import import_package, read_wiring
from tests.runtime.helpers import run, stage_state
from tests.runtime.tied_lm import write_model

codegen = pytest.importorskip("partitioner.generation.codegen")
profiler = pytest.importorskip("partitioner.profiler.profile")
plan_mod = pytest.importorskip("partitioner.plan")

torch.set_num_threads(1)


def _package(folder: Path, spec: str, batch: int, shape: tuple[int, ...] | None = None) -> Path:
    """A 2-stage 1f1b package of ``spec``, cut in the middle of its layers."""
    profile = profiler.profile_model(spec, batch_size=batch, input_shape=shape, repeats=1)
    ids = [n.id for n in profile.nodes]
    half = len(ids) // 2
    plan = plan_mod.Plan(
        gpus=2,
        cluster=plan_mod.Cluster.flat(2),
        schedule="1f1b",
        microbatches=2,
        stages=(plan_mod.Stage(0, tuple(ids[:half]), 1, (0,)), plan_mod.Stage(1, tuple(ids[half:]), 1, (1,))),
        predicted=plan_mod.Prediction(0.01),
        solver=plan_mod.SolverInfo("test", 0.0, True),
        batch_size=batch,
        model=profile.model,
    )
    codegen.write_package(profile, plan, folder)
    return folder


def _export(*args: str) -> Any:
    return CliRunner().invoke(main, ["export", *args])


def _stage_chain(pkg: ModuleType, ckpt: Path, step: int, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The trained stages of ``step`` chained in one process: what the pipeline computes."""
    wiring = read_wiring(pkg, 2)
    env = dict(inputs)
    for k in range(2):
        stage = pkg.stage(k).eval()
        stage.load_state_dict(stage_state(ckpt, step, k), strict=True)
        out = stage(*(env[n] for n in wiring.stage_inputs[k]))
        names = wiring.stage_outputs[k]
        env.update(zip(names, (out,) if len(names) == 1 else out, strict=True))
    return env[wiring.loss_input]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tied model trained 3 steps on 2 gloo ranks, a checkpoint after every step."""
    root = tmp_path_factory.mktemp("export")
    pkg = _package(root / "pkg", write_model(root), batch=4)
    ckpt = root / "ckpt"
    run(pkg, steps=3, lr=0.05, checkpoint_dir=str(ckpt), checkpoint_every=1)
    return pkg, ckpt


@pytest.mark.slow
def test_export_loads_strictly_into_the_factory_model_and_computes_the_stages_outputs(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    package, ckpt = trained
    out = tmp_path / "model.pt"
    result = _export(str(package), "--checkpoint-dir", str(ckpt), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert f"wrote {out}: step 3" in result.output
    assert "no stage holds 2 tensors (e.g. unused.weight)" in result.output
    state = torch.load(out, weights_only=True)
    assert {"embed.weight", "head.weight", "gain"} <= state.keys()  # the tied weight under both names
    assert "scratch" not in state
    held = [stage_state(ckpt, 3, k) for k in range(2)]
    assert "embed.weight" in held[0] and "head.weight" in held[1] and "embed.weight" not in held[1]

    factory = factory_from_spec(f"{package.parent / 'tied_lm.py'}:factory")
    model = factory().eval()
    model.load_state_dict(state, strict=True)
    assert model.head.weight is model.embed.weight
    assert not torch.equal(held[0]["embed.weight"], factory().embed.weight)  # it is the trained weight
    torch.testing.assert_close(model.embed.weight, held[0]["embed.weight"], rtol=0, atol=0)
    pkg = import_package(package)
    inputs = pkg.example_inputs(4, seed=5)
    with torch.no_grad():
        want = _stage_chain(pkg, ckpt, 3, inputs)
        got = model(inputs["input0"])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_export_takes_an_older_step_and_refuses_missing_incomplete_and_absent_ones(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    package, ckpt = trained
    out = tmp_path / "model.pt"
    assert _export(str(package), "--checkpoint-dir", str(ckpt), "--step", "2", "-o", str(out)).exit_code == 0
    torch.testing.assert_close(torch.load(out)["head.weight"], stage_state(ckpt, 2, 0)["embed.weight"])

    torn = tmp_path / "torn"
    shutil.copytree(ckpt, torn)
    (torn / "step-3" / "__1_0.distcp").unlink()  # a file lost after the step was written
    result = _export(str(package), "--checkpoint-dir", str(torn), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "skipped step-3: incomplete, no __1_0.distcp" in result.output and "step 2" in result.output

    refusals = {
        "no checkpoints in": ["--checkpoint-dir", str(tmp_path / "none")],
        "has no step-7; it has step-3, step-2, step-1": ["--checkpoint-dir", str(ckpt), "--step", "7"],
        "step-3 cannot be exported: incomplete, no __1_0.distcp": [
            "--checkpoint-dir",
            str(torn),
            "--step",
            "3",
        ],
    }
    for words, args in refusals.items():
        result = _export(str(package), *args, "-o", str(tmp_path / "x.pt"))
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error:") and len(result.output.strip().splitlines()) == 1
        assert words in result.output, result.output
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.slow
def test_hf_export_round_trips_through_save_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from runtime.building.hugging_face import factory

    package = _package(tmp_path / "pkg", "hf:gpt2", batch=4, shape=(16,))
    ckpt = tmp_path / "ckpt"
    run(package, steps=2, lr=0.05, checkpoint_dir=str(ckpt))
    result = _export(
        str(package),
        "--checkpoint-dir",
        str(ckpt),
        "-o",
        str(tmp_path / "model.pt"),
        "--max-shard-size",
        "200KB",
    )
    assert result.exit_code == 0, result.output
    hf_dir = tmp_path / "model-hf"
    assert f"wrote {hf_dir}" in result.output
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((hf_dir / s).is_file() for s in shards), shards
    assert "lm_head.weight" not in index["weight_map"]  # tied to transformer.wte.weight, as save_pretrained

    model = factory("hf:gpt2")().eval()
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    pkg = import_package(package)
    inputs = pkg.example_inputs(4, seed=3)
    names = {f"input{i}": pkg.TENSOR_NAMES[f"input{i}"] for i in range(len(inputs))}
    keyword = {names[k]: v for k, v in inputs.items()}
    with torch.no_grad():
        want = _stage_chain(pkg, ckpt, 2, inputs).logits  # (the last stage returns the model's output)
        torch.testing.assert_close(model(**keyword).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loaded(**keyword).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_safetensors_shards_one_at_a_time_hold_what_the_state_dict_holds(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    package, ckpt = trained
    assert (
        _export(str(package), "--checkpoint-dir", str(ckpt), "-o", str(tmp_path / "model.pt")).exit_code == 0
    )
    result = _export(
        str(package),
        "--checkpoint-dir",
        str(ckpt),
        "-o",
        str(tmp_path / "model.safetensors"),
        "--max-shard-size",
        "4KB",
    )
    assert result.exit_code == 0, result.output
    index_path = tmp_path / "model.safetensors.index.json"
    assert (
        f"wrote {index_path} (" in result.output
        and "left out (from_pretrained initialises them)" in result.output
    )
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    loaded = {k: v for f in files for k, v in load_file(tmp_path / f).items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in loaded.values())
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    # each tensor once (the tie under its first name), nothing no stage held, nothing left unsaved
    assert set(loaded) == set(state) - {"head.weight", "unused.weight", "unused.bias"}
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)
