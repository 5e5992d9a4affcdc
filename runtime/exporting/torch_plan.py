"""A package's plan in the forms torch.distributed.pipelining and torchtitan read.

``schedule.csv``: one row per rank, that rank's actions for one minibatch in torch's compute-only
notation (``0F0,0F1,0B0,...``; under zb1p and zbv a split backward is ``I`` for the input gradients
and ``W`` for the weights', torch's letters), as ``_PipelineScheduleRuntime._load_csv`` reads it; the
optimizer steps are left out (torch's ``schedule.step()`` runs one minibatch; the caller steps).
``stages.json``: per stage its rank, the original model's module paths and loose tensors it holds
(the FQNs torchtitan's ``module_fqns_per_model_part`` takes), and the tensors it reads and returns.
``torchtitan.toml``: the ``[parallelism]`` settings that use both.

Only what torch's pipelining can run is written: one rank per stage (torch combines pipelines with
data parallelism across whole pipelines, not replicas of one stage of different widths), a
synchronous schedule (pipedream's weight stashing runs several weight versions at once, which torch
has no form for), and each stage reading exactly what the previous one returns (torch's
``PipelineStage`` passes a stage's outputs to the next stage only, so a tensor that skips a stage
cannot be expressed). Anything else is refused in one line saying which.

A generated stage (``StageK`` of the package) is itself the ``PipelineStage``'s module: it computes
what the plan cut out of the model. torchtitan splits its own models by module FQNs instead, which
works for models written to tolerate missing modules (its own); for others, use the stage modules.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from runtime.errors import RunError
from runtime.files.atomic import write_text_atomic
from runtime.packages.job_config import JobConfig, load_job
from runtime.packages.load import Wiring, import_package, read_wiring
from runtime.schedule import Action, build, get_schedule

__all__ = ["TorchPlan", "export_torch_plan", "torch_plan"]


@dataclass(frozen=True)
class TorchPlan:
    """What torch's pipelining needs of a package.

    Attributes:
        rows: per rank, its compute actions for one minibatch in torch's notation.
        stages: per stage, its record for stages.json.
        microbatches: microbatches per minibatch.
        batch_size: samples per minibatch.
        schedule: pipeplan's schedule name.
        layout: a 3D plan's (t, d, shard) of every stage (docs/layout-3d.md); None: one rank a
            stage. ``rows``, ``microbatches`` and ``batch_size`` are then one copy's pipeline.
    """

    rows: tuple[tuple[str, ...], ...]
    stages: tuple[dict[str, Any], ...]
    microbatches: int
    batch_size: int
    schedule: str
    layout: tuple[int, int, str] | None = None

    def csv(self) -> str:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(self.rows)
        return out.getvalue()

    def torchtitan(self) -> str:
        """torchtitan's ``[parallelism]`` and ``[training]`` settings for this plan."""
        fqns = [s["modules"] + s["tensors"] for s in self.stages]
        ranks = len(self.rows)
        return (
            "# torchtitan settings for a pipeplan plan (module FQNs: torchtitan splits its own models\n"
            "# by them; for other models build each PipelineStage from the package's stage modules)\n"
            "[parallelism]\n"
            f"pipeline_parallel_degree = {ranks}\n"
            'pipeline_parallel_schedule = "_PipelineScheduleRuntime"\n'
            'pipeline_parallel_schedule_csv = "schedule.csv"\n'
            f"pipeline_parallel_microbatch_size = {self.batch_size // self.microbatches}\n"
            f"module_fqns_per_model_part = {json.dumps(fqns)}\n" + self._degrees() + "\n[training]\n"
            f"local_batch_size = {self.batch_size}\n"
        )

    def _degrees(self) -> str:
        """A 3D plan's tensor and data-parallel degrees in torchtitan's names (its mesh orders the
        ranks pipeline, data, tensor: the plan's data-major groups of consecutive ranks)."""
        if self.layout is None:
            return ""
        t, d, shard = self.layout
        lines = [f"tensor_parallel_degree = {t}"]
        if shard == "none":
            lines += [f"data_parallel_replicate_degree = {d}", "data_parallel_shard_degree = 1"]
        else:
            lines += ["data_parallel_replicate_degree = 1", f"data_parallel_shard_degree = {d}"]
        if shard in ("optimizer", "gradients"):  # (torchtitan has FSDP only: unsharded between F and B)
            lines.append(
                f'fsdp_reshard_after_forward = "never"  # pipeplan shard = {shard}: FSDP, kept unsharded'
            )
        return "".join(f"{line}\n" for line in lines)


def _torch_action(action: Action, schedule: str, microbatches: int) -> str | None:
    """``0B3`` in torch's letters (``I`` for a split backward's input half), the unit numbered within
    its minibatch; None for an optimizer step."""
    if action.kind == "S":
        return None
    kind = "I" if action.kind == "B" and get_schedule(schedule).split_backward else action.kind
    return f"{action.stage}{kind}{action.index % microbatches}"


def _rank_lists(job: JobConfig) -> list[Sequence[Action]]:
    """Every rank's actions for one minibatch."""
    return list(build(job.schedule, job.stage_ranks, job.microbatches))


def _check(job: JobConfig, wiring: Wiring) -> None:
    """Refuse what torch's pipelining cannot run, naming it."""
    if get_schedule(job.schedule).stashes:
        raise RunError(
            "torch's pipelining has no asynchronous schedule: pipedream keeps several weight versions in "
            "flight; partition with --schedule 1f1b (or gpipe, zb1p, interleaved, zbv)"
        )
    wide = [k for k, ranks in enumerate(job.stage_ranks) if len(ranks) > 1]
    if wide:
        raise RunError(
            f"stage {wide[0]} has {len(job.stage_ranks[wide[0]])} replicas; torch's pipelining runs one rank "
            "per stage (data parallelism goes across whole pipelines): partition with --straight"
        )
    for k in range(1, job.stages):
        if tuple(wiring.stage_inputs[k]) != tuple(wiring.stage_outputs[k - 1]):
            raise RunError(
                f"stage {k} reads {list(wiring.stage_inputs[k])} but stage {k - 1} returns "
                f"{list(wiring.stage_outputs[k - 1])}; torch's PipelineStage hands a stage exactly the "
                "previous stage's outputs (a tensor skipping a stage cannot be expressed)"
            )
    if tuple(wiring.stage_outputs[-1]) != (wiring.loss_input,):
        raise RunError(
            f"the last stage returns {list(wiring.stage_outputs[-1])}; torch's loss reads its one output"
        )


def _stage_record(package: Any, job: JobConfig, wiring: Wiring, k: int) -> dict[str, Any]:
    code = sys.modules.get(f"{package.__name__}.stage{k}")
    if code is None or not hasattr(code, "MODULES"):
        raise RunError(
            f"{job.package}/stage{k}.py lists no MODULES; export-plan needs a package written by "
            "`pipeplan partition`"
        )
    return {
        "stage": k,
        "rank": job.stage_ranks[k][0],
        "modules": list(code.MODULES),
        "tensors": list(getattr(code, "TENSORS", ())),
        "inputs": list(wiring.stage_inputs[k]),
        "outputs": list(wiring.stage_outputs[k]),
    }


def torch_plan(package: str | Path, schedule: str | None = None) -> TorchPlan:
    """The torch form of ``package``'s plan (under ``schedule``, default the plan's).

    Raises:
        RunError: a plan torch's pipelining cannot run, or a package not written by pipeplan.
    """
    job = load_job(package, schedule)
    layout = _layout(Path(job.package))
    if layout is not None:  # one copy's pipeline, a rank a stage (torchtitan's own degrees do the rest)
        group = layout[0] * layout[1]
        ranks = tuple((r[0] // group,) for r in job.stage_ranks)
        copies = layout[1]
        job = replace(
            job,
            stage_ranks=ranks,
            microbatches=job.microbatches // copies,
            batch_size=job.batch_size // copies,
        )
    pkg = import_package(job.package)
    wiring = read_wiring(pkg, job.stages, job.module_stages)
    _check(job, wiring)
    rows = tuple(
        tuple(a for a in (_torch_action(x, job.schedule, job.microbatches) for x in actions) if a is not None)
        for actions in _rank_lists(job)
    )
    stages = tuple(_stage_record(pkg, job, wiring, k) for k in range(job.stages))
    return TorchPlan(rows, stages, job.microbatches, job.batch_size, job.schedule, layout)


def _layout(folder: Path) -> tuple[int, int, str] | None:
    """A 3D plan's one (t, d, shard) from its plan.json (docs/layout-3d.md), None for a 2D plan.

    Raises:
        RunError: stages of different layouts (torchtitan takes one for the whole job).
    """
    try:
        stages = json.loads((folder / "plan.json").read_text(encoding="utf-8"))["stages"]
    except (OSError, ValueError, KeyError):
        return None
    found = {
        (int(s.get("tensor_parallel", 1)), int(s["replicas"]), str(s.get("shard", "none"))) for s in stages
    }
    if all(t == 1 and shard == "none" for t, _, shard in found):
        return None
    if len(found) > 1:
        raise RunError(f"torchtitan takes one layout for every stage; the plan has {sorted(found)}")
    return found.pop()


def export_torch_plan(package: str | Path, out_dir: str | Path, schedule: str | None = None) -> TorchPlan:
    """Write ``schedule.csv``, ``stages.json`` and ``torchtitan.toml`` into ``out_dir``."""
    plan = torch_plan(package, schedule)
    folder = Path(out_dir)
    doc = {
        "schema": "pipeplan.torch-plan/1",
        "schedule": plan.schedule,
        "microbatches": plan.microbatches,
        "batch_size": plan.batch_size,
        "torch_schedule": "torch.distributed.pipelining.schedules._PipelineScheduleRuntime",
        "stages": list(plan.stages),
    }
    for name, text in (
        ("schedule.csv", plan.csv()),
        ("stages.json", json.dumps(doc, indent=1) + "\n"),
        ("torchtitan.toml", plan.torchtitan()),
    ):
        write_text_atomic(folder / name, text)
    return plan
