"""The generated package: golden files, importability, stage chain == original model, ties, ranks, init."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from partitioner.errors import PackageError, PlanError
from partitioner.generation.codegen import with_ranks, write_package, write_package_from_trace
from partitioner.graph import Profile
from partitioner.models.specs import load_model
from partitioner.models.zoo import tiny
from partitioner.plan import Stage
from partitioner.verification.verify import load_package, verify_package
from runtime.building import stage_init as stagekit
from runtime.building.stage_init import loss_input
from tests.partitioner.codegen_support import plan_for, profile_for, profile_of

GOLDEN = Path(__file__).parents[1] / "golden" / "tiny-skip-gpus3"
REGEN = os.environ.get("PIPEPLAN_REGEN_GOLDEN") == "1"


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def skip_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-skip in 3 stages: ``act`` (after l1) is read by stage 1 and, skipping it, by stage 2."""
    options = {"spec": "tiny-skip", "batch_size": 2, "input_shape": None, "leaf_modules": [], "tracer": "fx"}
    profile = replace(profile_for("tiny-skip"), tracer_options=options)  # the header shows these: pin them
    out = tmp_path_factory.mktemp("pkg") / "gpus=3"
    write_package(profile, plan_for(profile, [3, 6]), out)
    return out


def test_golden_files(skip_package: Path) -> None:
    """The package text is stable; PIPEPLAN_REGEN_GOLDEN=1 rewrites tests/golden after a deliberate change."""
    copies = {"_stagekit.py": Path(stagekit.__file__), "_model.py": Path(tiny.__file__)}  # verbatim
    names = sorted(p.name for p in skip_package.iterdir() if p.name not in copies)
    if REGEN:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name in names:
            (GOLDEN / name).write_text((skip_package / name).read_text())
    assert names == sorted(p.name for p in GOLDEN.iterdir())
    for name in names:
        assert (skip_package / name).read_text() == (GOLDEN / name).read_text(), f"{name} differs from golden"
    for name, source in copies.items():
        assert (skip_package / name).read_text() == source.read_text(), name


def test_skip_tensor_named_in_every_signature(skip_package: Path) -> None:
    package, plan, conf = load_package(skip_package)
    entries = package.model(package.criterion())
    wiring = [(list(i), list(o)) for _, i, o in entries[:-1]]
    assert wiring == [(["input0"], ["out0"]), (["out0"], ["out1"]), (["out0", "out1"], ["out2"])]
    assert entries[-1][1:] == (["out2"], ["loss"])
    assert package.TENSOR_NAMES == {"input0": "x", "out0": "act", "out1": "l3", "out2": "head"}
    assert conf == {"module_to_stage_map": [0, 1, 2, 2], "stage_to_rank_map": {"0": [0], "1": [1], "2": [2]}}
    assert plan.extra["inputs"] == [{"name": "x", "shape": [2, 16], "dtype": "float32"}]
    assert plan.extra["stage_inputs"] == [["input0"], ["out0"], ["out0", "out1"]]


def test_pipedreams_shape_inference_loop_reads_the_package(skip_package: Path) -> None:
    """PipeDream's main_with_runtime.py, verbatim in substance: float32 zeros of each known shape into
    each stage, in model() order, recording every output's shape under its name."""
    package, _, _ = load_package(skip_package)
    model = package.model(package.criterion())
    training_tensor_shapes = {"input0": [5, 16], "target": [5]}
    for stage, inputs, outputs in model[:-1]:  # Skip last layer (loss).
        input_tensors = [torch.zeros(tuple(training_tensor_shapes[i]), dtype=torch.float32) for i in inputs]
        with torch.no_grad():
            output_tensors = stage(*tuple(input_tensors))
        if type(output_tensors) is not tuple:
            output_tensors = [output_tensors]
        for output, output_tensor in zip(outputs, list(output_tensors), strict=True):
            training_tensor_shapes[output] = list(output_tensor.size())
    assert training_tensor_shapes[model[-1][1][0]] == [5, 10]
    assert sorted(training_tensor_shapes) == ["input0", "out0", "out1", "out2", "target"]


_STANDALONE = """
import importlib.util, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("partitioner", "networkx", "click", "rich", "pulp"):
            raise ImportError("blocked " + name)
sys.meta_path.insert(0, Block())
folder = sys.argv[1]
init = folder + "/__init__.py"
spec = importlib.util.spec_from_file_location("pkg", init, submodule_search_locations=[folder])
pkg = importlib.util.module_from_spec(spec); sys.modules["pkg"] = pkg
spec.loader.exec_module(pkg)
env = dict(pkg.example_inputs(2))
for module, ins, outs in pkg.model(pkg.criterion()):
    if outs == ["loss"]:
        env["loss"] = module(env[ins[0]], pkg.example_targets(2))
        continue
    out = module.eval()(*(env[n] for n in ins))  # eval: no dropout, comparable with the original
    env.update(zip(outs, (out,) if len(outs) == 1 else out))
print("loss", float(env["loss"]))
print("stage0", sorted(n for n, _ in pkg.stage(0).named_parameters())[:2])
print("full", sum(p.numel() for p in pkg.full_model().parameters()))
print("modules", sorted(m for m in sys.modules if m.startswith("partitioner")))
"""


@pytest.mark.parametrize("spec", ["tiny-skip", "tiny-gpt", "tests/partitioner/codegen_models.py:size_later"])
def test_package_builds_and_trains_with_torch_and_runtime_only(tmp_path: Path, spec: str) -> None:
    """A cluster node has torch, the runtime and the model code, not the partitioner (nor its zoo):
    the package's stages, full model, example data and loss must build with ``partitioner`` blocked."""
    profile = profile_for(spec)
    write_package(profile, plan_for(profile, [2, 4]), tmp_path / "pkg")
    zoo = ":" not in spec  # a zoo model's source travels with the package; a model file stays the user's
    assert (tmp_path / "pkg" / "_model.py").is_file() == zoo
    result = subprocess.run(
        [sys.executable, "-c", _STANDALONE, str(tmp_path / "pkg")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "modules []" in result.stdout
    loss = float(result.stdout.split("loss ")[1].split()[0])
    expected = load_model(spec, 2)
    with torch.no_grad():
        want = expected.loss_fn(expected.build(0).eval()(*expected.make_inputs(2)), expected.make_targets(2))
    assert loss == pytest.approx(float(want), rel=1e-3)  # other threads in the subprocess: rounding


def _chain(package: object, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    entries = package.model(package.criterion(), seed)  # type: ignore[attr-defined]
    env = dict(package.example_inputs(4))  # type: ignore[attr-defined]
    for module, ins, outs in entries[:-1]:
        result = module(*(env[n] for n in ins))
        env.update(zip(outs, (result,) if len(outs) == 1 else result, strict=True))
    out = env[entries[-1][1][0]]
    loss = entries[-1][0](out, package.example_targets(4))  # type: ignore[attr-defined]
    loss.backward()
    grads = {n: p.grad for m, _, _ in entries[:-1] for n, p in m.named_parameters()}
    return out, loss, grads


def test_chain_matches_original_model_fork_and_join(tmp_path: Path) -> None:
    """tiny-cnn cut inside its residual block: outputs and every gradient equal the unsplit model's."""
    profile = profile_for("tiny-cnn")
    assert [n.id for n in profile.nodes][4:6] == ["conv_a", "relu_a"]
    write_package(profile, plan_for(profile, [5]), tmp_path / "pkg")
    package, _, _ = load_package(tmp_path / "pkg")
    out, loss, grads = _chain(package)
    bundle = load_model("tiny-cnn", 4)
    original = bundle.build(0)
    expected = loss_input(original(*bundle.make_inputs(4)))
    expected_loss = bundle.loss_fn(expected, bundle.make_targets(4))
    expected_loss.backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(loss, expected_loss)
    reference = dict(original.named_parameters())
    assert sorted(grads) == sorted(reference)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name].grad, msg=name)


def test_exact_init_is_the_original_models(tmp_path: Path) -> None:
    profile = profile_for("tiny-mlp")
    write_package(profile, plan_for(profile, [3]), tmp_path / "pkg", init="exact")
    package, _, _ = load_package(tmp_path / "pkg")
    original = load_model("tiny-mlp").build(seed=7)
    stage1 = package.stage(1, seed=7)
    assert sorted(n for n, _ in stage1.named_parameters()) == [
        "fc2.bias",
        "fc2.weight",
        "fc3.bias",
        "fc3.weight",
    ]
    for name, param in stage1.named_parameters():
        assert torch.equal(param, original.get_parameter(name)), name


def test_seeded_init_stage_equals_full_model(tmp_path: Path) -> None:
    """Per-module seeds: a stage built alone equals its layers in full_model(seed), not another seed's."""
    profile = profile_for("tiny-cnn")
    write_package(profile, plan_for(profile, [3, 6]), tmp_path / "pkg", init="seeded")
    package, _, _ = load_package(tmp_path / "pkg")
    full, other = package.full_model(3), package.full_model(4)
    for k in range(3):
        for name, tensor in package.stage(k, 3).state_dict().items():
            assert torch.equal(tensor, full.state_dict()[name]), name
            if tensor.is_floating_point() and tensor.numel() > 1 and tensor.std() > 0:
                assert not torch.equal(tensor, other.state_dict()[name]), name


def test_tied_embedding_across_stages(tmp_path: Path) -> None:
    """tiny-gpt's token embedding (stage 0) is its LM head (stage 3): both hold it, plan.json ties them."""
    profile = profile_for("tiny-gpt")
    final = write_package(profile, plan_for(profile, [4, 12, 24]), tmp_path / "pkg")
    assert [(t.name, t.members) for t in final.ties] == [
        ("wte.weight", ((0, "wte.weight"), (3, "lm_head.weight")))
    ]
    saved = json.loads((tmp_path / "pkg" / "plan.json").read_text())
    assert saved["ties"] == [{"name": "wte.weight", "members": [[0, "wte.weight"], [3, "lm_head.weight"]]}]
    package, _, _ = load_package(tmp_path / "pkg")
    assert torch.equal(
        package.stage(0).get_parameter("wte.weight"), package.stage(3).get_parameter("lm_head.weight")
    )


def test_replicated_plan_writes_rank_map(tmp_path: Path) -> None:
    profile = profile_for("tiny-mlp")
    final = write_package(profile, plan_for(profile, [4], replicas=[3, 1]), tmp_path / "pkg")
    conf = json.loads((tmp_path / "pkg" / "mp_conf.json").read_text())
    assert conf == {"module_to_stage_map": [0, 1, 1], "stage_to_rank_map": {"0": [0, 1, 2], "1": [3]}}
    assert [s.ranks for s in final.stages] == [(0, 1, 2), (3,)]


def test_writing_a_package_runs_the_graph_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor kinds and the output's shape come from one dry run (each is a pass over every node)."""
    import partitioner.generation.dry_run

    runs: list[int] = []
    real = partitioner.generation.dry_run.dry_run
    monkeypatch.setattr(
        partitioner.generation.dry_run, "dry_run", lambda gm, inputs: runs.append(1) or real(gm, inputs)
    )
    profile = profile_for("tiny-cnn")
    plan = write_package(profile, plan_for(profile, [2]), tmp_path / "pkg")
    assert runs == [1] and plan.extra["targets"]


def test_replacing_a_package_keeps_its_run(tmp_path: Path) -> None:
    """Partitioning again must not delete the previous run's metrics and checkpoints."""
    profile = profile_for("tiny-mlp")
    write_package(profile, plan_for(profile, [2]), tmp_path / "pkg")
    (tmp_path / "pkg" / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "pkg" / "run" / "metrics.json").write_text("{}")
    write_package(profile, plan_for(profile, [4]), tmp_path / "pkg")
    kept = [p.name for p in (tmp_path / "pkg").glob("run*")]
    assert len(kept) == 1 and kept[0].startswith("run.2")
    assert (tmp_path / "pkg" / kept[0] / "metrics.json").read_text() == "{}"
    assert json.loads((tmp_path / "pkg" / "mp_conf.json").read_text())["module_to_stage_map"] == [0, 1, 1]


def test_replacing_a_package_keeps_its_runs_folder_and_drops_the_link(tmp_path: Path) -> None:
    """A package of the folder-per-run layout: runs/ moves to runs.<time>, the run link goes (it would
    point into the old plan's runs), and the kept name is what partition reports."""
    from partitioner.generation.codegen import kept_runs

    profile = profile_for("tiny-mlp")
    write_package(profile, plan_for(profile, [2]), tmp_path / "pkg")
    (tmp_path / "pkg" / "runs" / "20260101-000000").mkdir(parents=True)
    (tmp_path / "pkg" / "runs" / "20260101-000000" / "metrics.json").write_text("{}")
    (tmp_path / "pkg" / "run").symlink_to("runs/20260101-000000")
    write_package(profile, plan_for(profile, [4]), tmp_path / "pkg")
    (kept,) = kept_runs(tmp_path / "pkg")
    assert kept.startswith("runs.2") and not (tmp_path / "pkg" / "run").exists()
    assert sorted(p.name for p in (tmp_path / "pkg").glob("run*")) == [kept]
    assert (tmp_path / "pkg" / kept / "20260101-000000" / "metrics.json").read_text() == "{}"


def test_weights_checkpoint(tmp_path: Path) -> None:
    """--weights: stages load their tensors from a full-model state_dict instead of initialising them."""
    trained = load_model("tiny-mlp").build(seed=42)
    torch.save(trained.state_dict(), tmp_path / "model.pt")
    profile = profile_for("tiny-mlp")
    write_package(profile, plan_for(profile, [2]), tmp_path / "pkg", weights=tmp_path / "model.pt")
    package, _, _ = load_package(tmp_path / "pkg")
    for k in range(2):
        for name, tensor in package.stage(k, seed=0).state_dict().items():
            assert torch.equal(tensor, trained.state_dict()[name]), name
    torch.save({"fc1.weight": torch.zeros(1)}, tmp_path / "partial.pt")
    with pytest.raises(PackageError, match="lack"):
        write_package(profile, plan_for(profile, [2]), tmp_path / "bad", weights=tmp_path / "partial.pt")


def test_plan_out_of_graph_order_is_rejected(tmp_path: Path) -> None:
    profile = profile_for("tiny-mlp")
    plan = plan_for(profile, [3])
    swapped = (Stage(0, plan.stages[1].nodes, 1, (0,)), Stage(1, plan.stages[0].nodes, 1, (1,)))
    with pytest.raises(PlanError, match="before its input"):
        write_package(profile, plan.__class__(**{**plan.__dict__, "stages": swapped}), tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()


def test_graph_txt_profile_writes_plan_files_only(tmp_path: Path) -> None:
    profile = profile_for("tiny-mlp")
    pipedream = Profile(nodes=profile.nodes, model="vgg16", tracer="pipedream")
    write_package(pipedream, plan_for(pipedream, [3]), tmp_path / "pkg")
    assert sorted(p.name for p in (tmp_path / "pkg").iterdir()) == ["mp_conf.json", "plan.json"]


def test_ranks_are_checked_or_assigned(tmp_path: Path) -> None:
    profile = profile_for("tiny-mlp")
    plan = plan_for(profile, [4], replicas=[3, 1])
    bare = plan.__class__(
        **{**plan.__dict__, "stages": tuple(Stage(s.index, s.nodes, s.replicas, ()) for s in plan.stages)}
    )
    assert [s.ranks for s in with_ranks(bare).stages] == [(0, 1, 2), (3,)]
    clash = (Stage(0, plan.stages[0].nodes, 3, (0, 1, 2)), Stage(1, plan.stages[1].nodes, 1, (2,)))
    with pytest.raises(PlanError, match="once each"):
        write_package(profile, plan.__class__(**{**plan.__dict__, "stages": clash}), tmp_path / "pkg")


def test_non_tensor_values_are_recomputed_not_sent(tmp_path: Path) -> None:
    """``n = x.size(0)`` planned into stage 0 but used in stage 2: stage 2 recomputes it from ``x``."""
    traced = profile_for("tests/partitioner/codegen_models.py:size_later")
    by_id = {n.id: n for n in traced.nodes}
    size, view = (
        replace(by_id["size"], members=("size",)),
        replace(by_id["size"], id="view", members=("view",)),
    )
    order = ["x", "size", "l1", "relu", "l2", "relu_1", "head", "view", "output"]
    nodes = tuple({**by_id, "size": size, "view": view}[i] for i in order)
    profile = replace(traced, nodes=nodes)
    write_package(profile, plan_for(profile, [3, 5]), tmp_path / "pkg")
    package, _, _ = load_package(tmp_path / "pkg")
    entries = package.model(package.criterion())
    assert [(list(i), list(o)) for _, i, o in entries[:-1]] == [
        (["input0"], ["input0", "out0"]),  # the model input, passed on under its PipeDream name
        (["out0"], ["out1"]),
        (["input0", "out1"], ["out2"]),
    ]
    stage2 = (tmp_path / "pkg" / "stage2.py").read_text()
    assert "size = x.size(0)" in stage2 and "view(size, -1)" in stage2
    assert verify_package(tmp_path / "pkg").ok


def test_plain_tensor_attribute_is_a_clear_error(tmp_path: Path) -> None:
    profile = profile_for("tests/partitioner/codegen_models.py:plain_tensor")
    with pytest.raises(PackageError, match="register_buffer"):
        write_package(profile, plan_for(profile, [2]), tmp_path / "pkg")


def test_profile_of_another_graph_is_rejected(tmp_path: Path) -> None:
    profile = profile_for("tiny-mlp")
    renamed = replace(profile, nodes=tuple(replace(n, members=(f"old_{n.id}",)) for n in profile.nodes))
    with pytest.raises(PlanError, match="profile it again"):
        write_package(renamed, plan_for(renamed, [3]), tmp_path / "pkg")


def test_traced_dropout_follows_the_stage_modules_mode(tmp_path: Path) -> None:
    """Tracing in training mode fixes ``training=self.training`` and ``dropout_p`` to constants; the
    stages tie them to their own ``self.training``: after ``eval()`` the chain is deterministic and
    equals the unsplit model's eval output, and in training mode it still drops out."""
    profile = profile_for("tests/partitioner/codegen_models.py:dropouts", input_shape=(8,))
    write_package(profile, plan_for(profile, [4]), tmp_path / "pkg")
    assert "self.training" in (tmp_path / "pkg" / "stage0.py").read_text()
    assert "self.training" in (tmp_path / "pkg" / "stage1.py").read_text()
    package, _, _ = load_package(tmp_path / "pkg")
    entries = package.model(package.criterion(), 0)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def chain() -> torch.Tensor:
        env = {entries[0][1][0]: x}
        for module, ins, outs in entries[:-1]:
            result = module(*(env[n] for n in ins))
            env.update(zip(outs, (result,) if len(outs) == 1 else result, strict=True))
        return env[entries[-1][1][0]]

    torch.manual_seed(0)
    trained = [chain(), chain()]
    assert not torch.equal(trained[0], trained[1])  # dropout is on in training mode
    for module, _, _ in entries[:-1]:
        module.eval()
    original = load_model("tests/partitioner/codegen_models.py:dropouts", 4, (8,)).build(0).eval()
    torch.testing.assert_close(chain(), original(x))
    torch.testing.assert_close(chain(), chain())


def test_constants_export_lifts_out_of_forward_are_written_into_the_stage_code(tmp_path: Path) -> None:
    """``torch.tensor(...)`` and a list index inside forward become graph attributes under torch.export;
    each stage that reads one makes it in its own code (no buffer the model could not rebuild)."""
    profile = profile_for(f"{Path(__file__).with_name('lifted_model.py')}:make")
    assert profile.tracer == "export"
    for cuts in ([2], [3], [2, 4]):
        write_package(profile, plan_for(profile, cuts), tmp_path / "pkg")
        code = "".join(p.read_text() for p in (tmp_path / "pkg").glob("stage*.py"))
        assert "torch.tensor([0.5, -0.5, 0.25, 0.0]" in code and "lifted_tensor" not in code
        assert verify_package(tmp_path / "pkg").ok


def test_a_model_traced_only_for_real_and_too_big_to_build_is_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lifted-constants model cannot be built weightless (its forward makes CPU tensors); built
    whole it would need more than half the free memory here: a PackageError, nothing written."""
    from partitioner.profiler import budget

    profile = profile_for(f"{Path(__file__).with_name('lifted_model.py')}:make")
    nodes = tuple(replace(n, param_bytes=2**30) if i == 1 else n for i, n in enumerate(profile.nodes))
    monkeypatch.setattr(budget, "free_bytes", lambda device: float(2**30))
    with pytest.raises(PackageError, match=r"cannot be traced without its weights.*more than half"):
        write_package(replace(profile, nodes=nodes), plan_for(profile, [2]), tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()


def test_an_exported_model_is_written_without_building_its_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.export's graph is traced on fake tensors of a model built weightless: the package is the
    one a real build and trace gives, byte for byte, and no weight was allocated on the way."""
    from partitioner.models import specs as models
    from partitioner.profiler.trace import trace_model

    bundle = load_model("hf:llama", 2, (8,))
    traced = trace_model(bundle, (), (8,))
    profile = profile_of(bundle, traced)
    assert profile.tracer == "export" and not profile.tracer_options["static_shapes"]
    plan = plan_for(profile, [len(profile.nodes) // 2])
    write_package_from_trace(profile, plan, tmp_path / "real", traced.graph_module, bundle, "export")
    builds: list[bool] = []
    seeded_call = models._seeded_call

    def recorded(*args: object, **kwargs: object) -> object:
        builds.append(bool(kwargs.get("lazy", args[3] if len(args) > 3 else False)))
        return seeded_call(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(models, "_seeded_call", recorded)
    write_package(profile, plan, tmp_path / "weightless")
    assert builds == [True]  # built once, weightless
    files = sorted(p.name for p in (tmp_path / "real").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "weightless").iterdir())
    for name in files:
        assert (tmp_path / "real" / name).read_bytes() == (tmp_path / "weightless" / name).read_bytes(), name
