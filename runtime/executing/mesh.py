"""The process groups and DeviceMesh of every 3D stage, created the same way on every rank.

Creating a group is collective over the whole job (``dist.new_group`` waits for every rank), so every
rank creates every 3D stage's groups, stage by stage, data groups before tensor groups, and keeps
its own; the stage's DeviceMesh (dims ``("data", "tensor")``) is then built from the rank's two
groups with ``DeviceMesh.from_group``, which creates none. A dimension of size 1 still gets its
one-rank group, so a stage's mesh is always 2D (DTensor and FSDP2 slice it by name).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from runtime.packages.job_config import JobConfig

__all__ = ["StageMesh", "stage_meshes"]


@dataclass(frozen=True)
class StageMesh:
    """What one rank of a 3D stage talks over.

    Attributes:
        data: its data-parallel group (the copies' ranks of its tensor rank).
        tensor: its copy's tensor-parallel group.
        mesh: the stage's DeviceMesh, ``("data", "tensor")``, ``copies x t``.
    """

    data: dist.ProcessGroup
    tensor: dist.ProcessGroup
    mesh: Any


def stage_meshes(job: JobConfig, rank: int, device_type: str, timeout: timedelta) -> dict[int, StageMesh]:
    """Every 3D stage's groups, created on every rank in the same order; this rank's meshes by stage."""
    from torch.distributed.device_mesh import DeviceMesh

    out: dict[int, StageMesh] = {}
    for k, ranks in enumerate(job.stage_ranks):
        lay = job.layout(k)
        if not lay.is_3d:
            continue
        t, d = lay.tensor_parallel, lay.copies
        data = [dist.new_group(list(ranks[j::t]), timeout=timeout) for j in range(t)]
        tensor = [dist.new_group(list(ranks[i * t : (i + 1) * t]), timeout=timeout) for i in range(d)]
        if rank in ranks:
            copy, j = divmod(ranks.index(rank), t)
            grid = torch.tensor(ranks, dtype=torch.int).reshape(d, t)
            mesh = DeviceMesh.from_group(
                [data[j], tensor[copy]], device_type, mesh=grid, mesh_dim_names=("data", "tensor")
            )
            out[k] = StageMesh(data[j], tensor[copy], mesh)
    return out
