"""runtime.packages.load on PipeDream's own layout: several modules per stage ([0, 0, 1, 1, 1])."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.packages.job_config import load_job
from runtime.packages.load import ModuleChain, build_stage, import_package, read_wiring
from tests.runtime.helpers import plain_training, run, stage_state
from tests.runtime.packages import write_package

torch.set_num_threads(1)


def test_several_modules_per_stage_are_wired_and_chained(tmp_path: Path) -> None:
    """Stage 0 returns both its modules' outputs (stage 1 reads both), read in first-use order."""
    pkg_dir = write_package(tmp_path / "pkg", "modules", replicas=(1, 1))
    job = load_job(pkg_dir)
    assert job.module_stages == (0, 0, 1, 1, 1)
    pkg = import_package(pkg_dir)
    assert not hasattr(pkg, "stage")
    wiring = read_wiring(pkg, job.stages, job.module_stages)
    assert wiring.stage_inputs == (("input0",), ("out1", "out0"))
    assert wiring.stage_outputs == (("out0", "out1"), ("out3",))
    assert wiring.consumers(0) == {1: ("out1", "out0")}
    full = pkg.full_model(0)
    x = torch.randn(4, 6)
    stages = [build_stage(pkg, wiring, k, job.module_stages, seed=0) for k in range(2)]
    assert all(isinstance(s, ModuleChain) for s in stages)
    out0, out1 = stages[0](x)
    torch.testing.assert_close(stages[1](out1, out0), full(x))
    for k, stage in enumerate(stages):
        want = {f"parts.{i}.{n}": t for i in range(2) for n, t in full.stages[2 * k + i].state_dict().items()}
        assert stage.state_dict().keys() == want.keys()
        assert all(torch.equal(stage.state_dict()[n], want[n]) for n in want)


@pytest.mark.slow
def test_pipedream_layout_trains_like_plain_training(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "modules", replicas=(1, 1), microbatches=2, batch_size=4)
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=3, schedule="1f1b", lr=0.1, momentum=0.9, checkpoint_dir=str(ckpt))
    model = plain_training(pkg, 3, 2, 4, lr=0.1, momentum=0.9)
    for k in range(2):
        got = stage_state(ckpt, 3, k)
        for i in range(2):
            for name, want in model.stages[2 * k + i].state_dict().items():
                torch.testing.assert_close(got[f"parts.{i}.{name}"], want, rtol=1e-5, atol=1e-6)
