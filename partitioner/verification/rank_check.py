"""What each rank of a 3D package's check runs: its stage built, split and sharded as a training rank
builds it, one forward and backward on its copy's part, and every tensor gathered whole and compared.

The building is the runtime's own: the job read by :func:`runtime.packages.job_config.load_job`,
every 3D stage's groups and mesh by :func:`runtime.executing.mesh.stage_meshes` (created in one
order on every rank), the stage by :func:`runtime.packages.load.build_stage` and split over its
tensor ranks and sharded over its copies by :func:`runtime.job.stage3d.distribute` (DTensor weights,
FSDP2), FSDP2's switches set by :func:`runtime.executing.sharding.before_backward` for a copy's last
backward (and, under a split backward, the gradients reduced by hand as at the step), a replicated
tensor-parallel stage's gradients summed over its copies by the runtime's own bucketed all-reduce.
What it does not play is the schedule: its inputs and its outputs' gradients come from
:mod:`partitioner.verification.rank_cases`' files instead of neighbouring stages.

Compared, on every rank of the stage (each copy against its own part):

- its weights gathered whole (``full_tensor``) against the stage it built before splitting them;
- its outputs and its inputs' gradients against the plain stage's on the same part;
- its weights' gradients gathered whole (summed over the copies by their collectives) against the
  plain stage's, summed over the parts.

Every rank makes the same collectives in the same order (a comparison never skips one), so a
mismatch is reported, never waited on. Memory: what a training rank holds while it builds its stage
(the whole stage, until it is split and sharded: its built tensors are kept, not copied, until
compared), then one tensor gathered whole at a time against the plain gradients, read memory-mapped.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.verification.rank_cases import case_file, grads_file
from partitioner.verification.verify import _close, _max_error
from runtime.building.stage_init import loss_input
from runtime.executing.comm import Comm
from runtime.executing.mesh import StageMesh, stage_meshes
from runtime.executing.recompute import run_forward
from runtime.executing.sharding import before_backward, reduce_gradients
from runtime.faults.die_with_launcher import die_with
from runtime.job.stage3d import distribute
from runtime.job.worker import share_cores
from runtime.observing.peak_memory import local
from runtime.packages.job_config import RankConfig, load_job
from runtime.packages.load import Wiring, build_stage, import_package, read_wiring
from runtime.schedule import get_schedule
from runtime.settings.run_options import RunOptions

__all__ = ["RankCheck", "RankTask", "check_rank"]


@dataclass(frozen=True)
class RankTask:
    """What every rank is told (pickled to it by the launcher).

    Attributes:
        options: the package and the launch's settings (gloo, the timeout, the launcher's pid).
        cases: the folder of :mod:`partitioner.verification.rank_cases`' files.
        seed: the initialisation seed of the stages, as the one-process check's.
        rtol: relative tolerance.
        atol: absolute tolerance.
    """

    options: RunOptions
    cases: str
    seed: int
    rtol: float
    atol: float


@dataclass(frozen=True)
class RankCheck:
    """How one rank's share of a 3D stage compares with the plain stage.

    Attributes:
        rank: global rank.
        stage: the stage it runs.
        copy: its copy of the stage (the part of the minibatch it ran).
        tensor_rank: its place in the copy's tensor group.
        params: parameter elements of the whole stage.
        init_error: max |gathered - built| over its weights.
        output_error: max |rank - plain| over its outputs (the last stage's as the loss reads them).
        input_grad_error: max |rank - plain| over its inputs' gradients.
        grad_error: max |gathered - plain| over its weights' gradients.
        ok: weights equal, everything else within tolerance.
    """

    rank: int
    stage: int
    copy: int
    tensor_rank: int
    params: int
    init_error: float
    output_error: float
    input_grad_error: float
    grad_error: float
    ok: bool


def check_rank(task: RankTask) -> list[RankCheck]:
    """This rank's checks, one per 3D stage it hosts (none on a rank of plain stages only, which
    still joins the group creation every rank takes part in)."""
    rank, options = int(os.environ["RANK"]), task.options
    die_with(options.launcher_pid or os.getppid())
    share_cores()
    timeout = timedelta(seconds=options.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    job = load_job(options.package)
    meshes = stage_meshes(job, rank, "cpu", timeout)
    package = import_package(job.package)
    wiring = read_wiring(package, job.stages, job.module_stages)
    found = [
        _check_stage(package, wiring, cfg, meshes[cfg.stage], task)
        for cfg in job.hosted(rank)
        if cfg.layout.is_3d
    ]
    dist.destroy_process_group()  # (only on success: a failing rank's error is then the one on record)
    return found


def _check_stage(package: Any, wiring: Wiring, cfg: RankConfig, mesh: StageMesh, task: RankTask) -> RankCheck:
    """Stage ``cfg.stage`` as this rank holds it, run on its copy's part and compared."""
    k, job = cfg.stage, cfg.job
    module = build_stage(package, wiring, k, job.module_stages, task.seed, "cpu")
    built = {n: p.detach() for n, p in module.named_parameters()}  # (kept, not copied: splitting and
    # sharding copy what they keep, so the stage's built tensors live only until compared)
    size = sum(p.numel() for p in built.values())
    module = distribute(module, cfg, mesh, task.options).train()
    params = dict(module.named_parameters())
    init = _compare(((params[n], built.pop(n)) for n in list(built)), 0.0, 0.0)
    case = torch.load(case_file(Path(task.cases), k, cfg.replica), weights_only=True)
    leaves = {n: _leaf(v, n in case["needs_grad"]) for n, v in case["inputs"].items()}
    outputs = _forward_backward(package, wiring, cfg, module, leaves, case)
    _sum_copies(cfg, module, mesh)
    tol = (task.rtol, task.atol)
    got_out = _compare(((outputs.get(n), ref) for n, ref in case["outputs"].items()), *tol)
    got_in = _compare(
        ((getattr(leaves[n], "grad", None), ref) for n, ref in case["input_grads"].items()), *tol
    )
    want: dict[str, torch.Tensor] = torch.load(grads_file(Path(task.cases), k), weights_only=True, mmap=True)
    grads = _compare(((p.grad, want.get(n)) for n, p in params.items()), *tol)
    return RankCheck(
        cfg.rank, k, cfg.replica, cfg.tensor_rank, size, init[0], got_out[0], got_in[0], grads[0],
        init[1] and got_out[1] and got_in[1] and grads[1],
    )  # fmt: skip


def _leaf(value: Any, needs_grad: bool) -> Any:
    """An input as the stage receives it: a fresh leaf, needing a gradient where its sender's did."""
    return value.detach().requires_grad_(needs_grad) if isinstance(value, torch.Tensor) else value


def _forward_backward(
    package: Any, wiring: Wiring, cfg: RankConfig, module: nn.Module, leaves: dict[str, Any], case: Any
) -> dict[str, torch.Tensor]:
    """One forward (recomputed in backward where the plan says so) and its backward, from the
    later stages' gradients or, on the last stage, the loss; returns the outputs compared."""
    k, shard = cfg.stage, cfg.layout.shard
    split = get_schedule(cfg.job.schedule).split_backward
    names = wiring.stage_outputs[k]
    torch.set_rng_state(case["rng"])
    result = run_forward(module, tuple(leaves[n] for n in wiring.stage_inputs[k]), cfg.recompute)
    results = (result,) if len(names) == 1 else tuple(result)
    if shard != "none":
        before_backward(module, shard, True, split)
    named = dict(zip(names, results, strict=True))
    if cfg.is_last:
        package.criterion()(results[0], case["targets"]).backward()
        named = {names[0]: loss_input(results[0])}
    else:
        pairs = [
            (named[n], g) for n, g in case["output_grads"].items()
            if isinstance(named.get(n), torch.Tensor) and named[n].requires_grad
        ]  # fmt: skip
        if pairs:
            torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
    if shard != "none" and split:
        reduce_gradients(module)
    return {n: r.detach() for n, r in named.items() if isinstance(r, torch.Tensor)}


def _sum_copies(cfg: RankConfig, module: nn.Module, mesh: StageMesh) -> None:
    """A tensor-parallel stage that does not shard sums its copies' gradients as its step does (the
    runtime's bucketed all-reduce over its data group); FSDP2 summed a sharded stage's already."""
    lay = cfg.layout
    if lay.shard == "none" and lay.copies > 1:
        grads = [local(p.grad) for p in module.parameters() if p.grad is not None]
        Comm(dist.group.WORLD, torch.device("cpu")).all_reduce_sum(grads, mesh.data)  # type: ignore[arg-type]


def _whole(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor as one rank holds it, gathered whole where it is a DTensor (a collective)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(
    pairs: Iterable[tuple[Any, torch.Tensor | None]], rtol: float, atol: float
) -> tuple[float, bool]:
    """(max |a - b|, all within tolerance) over ``pairs``, each gathered whole first; every pair is
    visited (the gathering is collective), and tolerance 0 asks for equality."""
    worst, ok = 0.0, True
    for a, b in pairs:
        with torch.no_grad():
            whole = _whole(a)
        error = _max_error([(whole, b)])
        worst = max(worst, error)
        ok = ok and (error == 0.0 if rtol == atol == 0.0 else _close(whole, b, rtol, atol))
    return worst, ok
