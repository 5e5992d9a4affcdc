"""A checkpoint survives a re-plan: trained on one plan, resumed on another (other cuts, a replicated
stage, more GPUs, another schedule), the weights and Adam's state equal plain training's.

The model's token embedding is tied to its LM head (:mod:`tests.runtime.tied_lm`), so the tied tensor
moves from two stages (two copies, one optimizer state each) to one stage and back.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from runtime.checkpoints.read_tensors import Tensors
from runtime.checkpoints.step_folders import saved_tensors
from runtime.datasets.minibatches import SyntheticBatches
from runtime.errors import RunError
from runtime.packages.load import import_package, read_wiring
from tests.runtime.helpers import run
from tests.runtime.tied_lm import write_model

codegen = pytest.importorskip("partitioner.generation.codegen")
profiler = pytest.importorskip("partitioner.profiler.profile")
plan_mod = pytest.importorskip("partitioner.plan")

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

BATCH, MICRO, LR = 8, 4, 3e-3


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> object:
    return profiler.profile_model(write_model(tmp_path_factory.mktemp("model")), batch_size=BATCH, repeats=1)


def _package(
    profile: object, out: Path, cuts: Sequence[float], replicas: Sequence[int], schedule: str = "1f1b"
) -> Path:
    """A package of ``profile`` cut at the given fractions of its layers, with ``replicas`` per stage."""
    ids = [n.id for n in profile.nodes]  # type: ignore[attr-defined]
    edges = [0, *(round(c * len(ids)) for c in cuts), len(ids)]
    first, stages = 0, []
    for k, r in enumerate(replicas):
        stages.append(
            plan_mod.Stage(k, tuple(ids[edges[k] : edges[k + 1]]), r, tuple(range(first, first + r)))
        )
        first += r
    plan = plan_mod.Plan(
        gpus=first,
        cluster=plan_mod.Cluster.flat(first),
        schedule=schedule,
        microbatches=MICRO,
        stages=tuple(stages),
        predicted=plan_mod.Prediction(0.01),
        solver=plan_mod.SolverInfo("test", 0.0, True),
        batch_size=BATCH,
        model=profile.model,  # type: ignore[attr-defined]
    )
    codegen.write_package(profile, plan, out)
    return out


def _plain(package: Path, steps: int) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The model whole in one process, Adam, gradients accumulated over the same microbatches: its
    weights and Adam's state by parameter name."""
    pkg = import_package(package)
    model, loss_fn = pkg.full_model(0), pkg.criterion()
    data = SyntheticBatches(pkg, read_wiring(pkg, 2).stage_inputs[0], BATCH, seed=0)
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        xs = [x.tensor_split(MICRO) for x in data.inputs(step)]
        for j, y in enumerate(data.targets(step).tensor_split(MICRO)):
            (loss_fn(model(*[x[j] for x in xs]), y) / MICRO).backward()
        optim.step()
        optim.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    return model.state_dict(), {names[id(p)]: s for p, s in optim.state.items()}


def _assert_like_plain(ckpt: Path, step: int, plain: tuple[dict[str, torch.Tensor], dict[str, dict]]) -> None:
    weights, moments = plain
    saved = Tensors.open(ckpt / f"step-{step}")
    assert set(weights) - set(saved.specs) == {"unused.weight", "unused.bias"}  # no stage holds these
    for name, got in saved.read(n for n in weights if n in saved.specs).items():
        torch.testing.assert_close(got, weights[name], rtol=1e-5, atol=1e-6, msg=name)
    moments_saved = Tensors(saved.folder, saved_tensors(ckpt, step, prefix="optimizer.state."))
    for name, state in moments.items():
        got = moments_saved.read([f"{name}.{k}" for k in state], prefix="optimizer.state.")
        for k, v in state.items():
            torch.testing.assert_close(got[f"{name}.{k}"], v, rtol=1e-5, atol=1e-7, msg=f"{name}.{k}")


def test_resume_on_a_three_stage_plan_with_a_replica_equals_plain_training(
    tmp_path: Path, profile: object
) -> None:
    two = _package(profile, tmp_path / "two", [0.5], [1, 1])
    three = _package(profile, tmp_path / "three", [0.3, 0.7], [1, 2, 1])
    ckpt = tmp_path / "ckpt"
    common = {"optimizer": "adam", "lr": LR, "checkpoint_dir": str(ckpt)}
    run(two, steps=4, **common)
    run(three, steps=8, resume=True, **common)
    _assert_like_plain(ckpt, 8, _plain(two, 8))


def test_resume_across_schedules_and_gpu_counts_needs_accepting_the_schedule_change(
    tmp_path: Path, profile: object
) -> None:
    """1 GPU (its one stage holds the tied tensor once, with one optimizer state) -> 3 GPUs (two
    copies) -> 2 GPUs under zb1p."""
    one = _package(profile, tmp_path / "one", [], [1])
    three = _package(profile, tmp_path / "three", [0.3, 0.7], [1, 1, 1])
    two = _package(profile, tmp_path / "two", [0.6], [1, 1], schedule="zb1p")
    ckpt = tmp_path / "ckpt"
    common = {"optimizer": "adam", "lr": LR, "checkpoint_dir": str(ckpt)}
    run(one, steps=2, **common)
    run(three, steps=4, resume=True, **common)
    with pytest.raises(RunError, match=r"resuming would change the run: --schedule 1f1b -> zb1p"):
        run(two, steps=6, resume=True, **common)
    run(two, steps=6, resume=True, accept_changes=True, **common)
    _assert_like_plain(ckpt, 6, _plain(two, 6))
