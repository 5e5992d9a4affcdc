"""A 3D stage put together: its groups and mesh (:mod:`runtime.executing.mesh`), its weights split over tensor
ranks (:mod:`runtime.executing.tensor_parallel`) and sharded over copies (:mod:`runtime.executing.sharding`),
and the hook that tells FSDP2 which backward is a copy's last. The worker calls these three functions only
for jobs with a 3D stage; plain replicated stages keep the bucketed all-reduce (runtime/executing/comm.py)."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from datetime import timedelta

import torch.distributed as dist
from torch import nn

from runtime.errors import RunError
from runtime.executing.mesh import StageMesh, stage_meshes
from runtime.executing.sharding import before_backward, reduce_gradients, shard_stage
from runtime.executing.stage import Groups, StageRuntime
from runtime.executing.tensor_parallel import read_plan, split_stage
from runtime.packages.job_config import RankConfig
from runtime.schedule import get_schedule
from runtime.settings.run_options import RunOptions

__all__ = ["chunk_groups", "distribute", "groups", "hooked"]

log = logging.getLogger(__name__)


def groups(base: Groups, cfg: RankConfig, timeout: timedelta) -> Groups:
    """``base`` with every 3D stage's groups created (on every rank, in one order) and this rank's
    kept: its data group replaces the replica group (summing gradients where the stage does not
    shard, only the losses where it does)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    meshes = stage_meshes(cfg.job, cfg.rank, device, timeout)
    if cfg.stage not in meshes:
        return replace(base, meshes=meshes)
    lay = cfg.layout
    data = meshes[cfg.stage].data if lay.copies > 1 else None
    return replace(base, replicas=data, meshes=meshes, sharded=lay.shard != "none")


def chunk_groups(first: Groups, cfg: RankConfig) -> Groups:
    """The groups of another stage this rank hosts (interleaved, zbv: its chunks share the first's
    groups): that stage's own data group and whether it shards. Stages on one rank hold the same
    ranks (each copy of the stages is a pipeline of its own), so a stage without a mesh keeps the
    first's replica group, which has its ranks."""
    if not cfg.job.is_3d:
        return first
    if cfg.stage not in first.meshes:
        return replace(first, sharded=False)
    lay = cfg.layout
    data = first.meshes[cfg.stage].data if lay.copies > 1 else None
    return replace(first, replicas=data, sharded=lay.shard != "none")


def distribute(module: nn.Module, cfg: RankConfig, mesh: StageMesh, options: RunOptions) -> nn.Module:
    """The stage split over its copy's tensor ranks and sharded over its copies, in place.

    Raises:
        RunError: a setting 3D stages do not run yet, or a degree a layer does not divide.
    """
    if options.optim.clip_grad_norm is not None:
        raise RunError("--clip-grad-norm does not run on 3D layouts yet (its norm over DTensor shards)")
    if options.eval_data is not None:
        raise RunError("--eval-data does not run on 3D layouts yet (its routing between tensor ranks)")
    lay = cfg.layout
    if lay.tensor_parallel > 1:
        plan = read_plan(cfg.job.package)
        split = split_stage(module, plan, mesh.mesh["tensor"], mesh.tensor, cfg.tensor_rank, cfg.stage)
        if cfg.leads:
            log.info(
                "stage %d: %d layers split %d ways, the rest whole",
                cfg.stage,
                len(split),
                lay.tensor_parallel,
            )
    if lay.shard != "none":
        halves = get_schedule(cfg.job.schedule).split_backward
        module = shard_stage(module, mesh.mesh["data"], lay.shard, halves)
    return module


def _before(rt: StageRuntime, unit: int) -> None:
    """Before ``unit``'s backward: whether it is the copy's last of the minibatch (the schedules that
    fuse their backwards play a copy's backwards of a stage in unit order); under a split backward
    no backward reduces (:func:`runtime.executing.sharding.reduce_gradients` at the step does)."""
    job, copy = rt.cfg.job, rt.cfg.replica
    m, d = job.microbatches, rt.cfg.layout.copies
    last = max(j for j in range(m) if j % d == copy)
    before_backward(rt.module, rt.cfg.layout.shard, unit % m == last, rt.schedule.split_backward)


def hooked(rt: StageRuntime) -> StageRuntime:
    """``rt`` with FSDP2's per-backward switches set where its stage is sharded, and under a split
    backward its gradients reduced before each step."""
    if rt.cfg.layout.shard != "none":
        rt.before_backward = functools.partial(_before, rt)
        if rt.schedule.split_backward:
            rt.before_step = functools.partial(reduce_gradients, rt.module)
    return rt
