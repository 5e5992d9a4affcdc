"""The runtime on a package written by the code generator (interface 5), not a hand-written one.

Skipped when the partitioner's profiler or code generator is not importable; the runtime itself never
imports the partitioner.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.datasets.minibatches import SyntheticBatches
from runtime.packages.load import import_package, read_wiring
from tests.runtime.helpers import run, stage_state

codegen = pytest.importorskip("partitioner.generation.codegen")
profiler = pytest.importorskip("partitioner.profiler.profile")
plan_mod = pytest.importorskip("partitioner.plan")

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


def _package(tmp_path: Path, spec: str, stages: int, micro: int, batch: int) -> Path:
    profile = profiler.profile_model(spec, batch_size=batch, repeats=1)
    ids = [n.id for n in profile.nodes]
    cuts = [round(i * len(ids) / stages) for i in range(stages + 1)]
    plan = plan_mod.Plan(
        gpus=stages,
        cluster=plan_mod.Cluster.flat(stages),
        schedule="1f1b",
        microbatches=micro,
        stages=tuple(plan_mod.Stage(k, tuple(ids[cuts[k] : cuts[k + 1]]), 1, (k,)) for k in range(stages)),
        predicted=plan_mod.Prediction(0.01),
        solver=plan_mod.SolverInfo("test", 0.0, True),
        batch_size=batch,
        model=profile.model,
    )
    out = tmp_path / "pkg"
    codegen.write_package(profile, plan, out)
    return out


@pytest.mark.parametrize("spec", ["tiny-mlp", "tiny-skip"])
def test_generated_package_trains_exactly_like_its_full_model(tmp_path: Path, spec: str) -> None:
    stages, micro, batch, steps = 2, 2, 8, 3
    pkg_dir = _package(tmp_path, spec, stages, micro, batch)
    ckpt = tmp_path / "ckpt"
    run(pkg_dir, steps=steps, lr=0.05, momentum=0.9, checkpoint_dir=str(ckpt))

    pkg = import_package(pkg_dir)
    model, loss_fn = pkg.full_model(0), pkg.criterion()
    names = read_wiring(pkg, stages).stage_inputs[0]
    data = SyntheticBatches(pkg, names, batch, seed=0)
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        xs = [x.tensor_split(micro) for x in data.inputs(step)]
        for j, y in enumerate(data.targets(step).tensor_split(micro)):
            (loss_fn(model(*[x[j] for x in xs]), y) / micro).backward()
        optim.step()
        optim.zero_grad()
    want = model.state_dict()
    for k in range(stages):
        for name, tensor in stage_state(ckpt, steps, k).items():
            torch.testing.assert_close(tensor, want[name], rtol=1e-5, atol=1e-6, msg=f"stage{k}.{name}")
