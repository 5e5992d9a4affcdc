"""export-plan: a straight plan in torch's CSV form, which torch.distributed.pipelining itself runs
to the losses pipeplan's runtime gets; what torch cannot run is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

from runtime.datasets.minibatches import SyntheticBatches
from runtime.errors import RunError
from runtime.exporting.torch_plan import export_torch_plan, torch_plan
from runtime.packages.job_config import load_job
from runtime.packages.load import import_package, read_wiring
from tests.runtime.generated import generate
from tests.runtime.helpers import run
from tests.runtime.packages import write_package

LR, STEPS = 0.05, 3


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(
        tmp_path_factory.mktemp("mlp") / "pkg", "tiny-mlp", (1, 1), "1f1b", microbatches=4, batch_size=8
    )


def test_the_schedule_is_torch_s_notation_for_one_minibatch(straight: Path) -> None:
    plan = torch_plan(straight)
    m = plan.microbatches
    assert plan.rows[0][:2] == ("0F0", "0F1") and plan.rows[1][:2] == ("1F0", "1B0")
    for row in plan.rows:  # every unit's forward and backward once, in torch's own parser
        actions = [_Action.from_str(a) for a in row]
        assert sorted(str(a.computation_type.value) + str(a.microbatch_index) for a in actions) == sorted(
            [f"F{j}" for j in range(m)] + [f"B{j}" for j in range(m)]
        )
    zb = torch_plan(straight, "zb1p")
    assert {a[1] for row in zb.rows for a in row} == {"F", "I", "W"}
    assert [s["modules"] for s in plan.stages] and all(s["rank"] == s["stage"] for s in plan.stages)


@pytest.mark.parametrize(
    ("kind", "replicas", "schedule", "words"),
    [
        ("chain", (2, 1), "1f1b", "stage 0 has 2 replicas; torch's pipelining runs one rank per stage"),
        ("chain", (1, 1), "pipedream", "torch's pipelining has no asynchronous schedule"),
        ("skip", (1, 1, 1), "1f1b", "a tensor skipping a stage cannot be expressed"),
        (
            "chain",
            (1, 1),
            "1f1b",
            "lists no MODULES; export-plan needs a package written by `pipeplan partition`",
        ),
    ],
)
def test_what_torch_cannot_run_is_refused(
    tmp_path: Path, kind: str, replicas: tuple[int, ...], schedule: str, words: str
) -> None:
    pkg = write_package(tmp_path / "pkg", kind, replicas, schedule)
    with pytest.raises(RunError, match=words):
        torch_plan(pkg)


def _torch_rank(rank: int, package: str, folder: str) -> None:
    """One rank of torch's own pipelining: the package's stage, the exported CSV, SGD."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    pkg, job = import_package(package), load_job(package)
    module = pkg.stage(rank, seed=0)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = _PipelineScheduleRuntime([stage], n_microbatches=job.microbatches, loss_fn=pkg.criterion())
    schedule._load_csv(f"{folder}/schedule.csv")
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    data = SyntheticBatches(pkg, read_wiring(pkg, 2).stage_inputs[0], job.batch_size, seed=0)
    losses = []
    for step in range(STEPS):
        if rank == 0:
            schedule.step(*data.inputs(step))
        else:
            parts: list[torch.Tensor] = []
            schedule.step(target=data.targets(step), losses=parts)
            losses.append(float(torch.stack(parts).mean()))
        optimizer.step()
        optimizer.zero_grad()
    if rank == 1:
        Path(folder, "losses.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


@pytest.mark.slow
def test_torch_pipelining_runs_the_exported_plan_to_pipeplan_s_losses(straight: Path, tmp_path: Path) -> None:
    export_torch_plan(straight, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"schedule.csv", "stages.json", "torchtitan.toml"}
    torch.multiprocessing.start_processes(
        _torch_rank, args=(str(straight), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    theirs = json.loads((tmp_path / "losses.json").read_text())
    ours = run(straight, steps=STEPS, lr=LR, schedule="1f1b", run_dir=str(tmp_path / "run"))["losses"]
    assert len(theirs) == STEPS and theirs[0] != theirs[-1]
    assert theirs == pytest.approx(ours, rel=1e-5, abs=1e-6)


def test_a_3d_plan_exports_one_copy_s_pipeline_and_torchtitan_s_degrees(
    straight: Path, tmp_path: Path
) -> None:
    """docs/layout-3d.md: TP2 x DP2 (optimizer) every stage -> torchtitan's degrees, one copy's ranks."""
    import shutil

    pkg = tmp_path / "pkg3d"
    shutil.copytree(straight, pkg)
    plan = json.loads((pkg / "plan.json").read_text())
    conf = json.loads((pkg / "mp_conf.json").read_text())
    for k, stage in enumerate(plan["stages"]):
        ranks = list(range(4 * k, 4 * k + 4))
        stage.update(tensor_parallel=2, replicas=2, shard="optimizer", ranks=ranks)
        conf["stage_to_rank_map"][str(k)] = ranks
    plan["gpus"] = 8
    (pkg / "plan.json").write_text(json.dumps(plan))
    (pkg / "mp_conf.json").write_text(json.dumps(conf))
    done = torch_plan(pkg)
    assert done.layout == (2, 2, "optimizer") and len(done.rows) == 2
    assert done.batch_size == 4 and done.microbatches == 2  # (one copy's half of 8 samples, 4 microbatches)
    toml = done.torchtitan()
    assert "tensor_parallel_degree = 2" in toml and "data_parallel_shard_degree = 2" in toml
    assert "pipeline_parallel_degree = 2" in toml and "local_batch_size = 4" in toml
