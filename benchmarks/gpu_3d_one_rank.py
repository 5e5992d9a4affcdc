"""The runtime's 3D code paths that a world of one can run, on one process: the GPU kit's ``3d`` step
on a single GPU (nccl on ``cuda:0``), and on gloo in its ``--cpu`` mode, so the suite runs this code.

Every 3D layout has ``t * d >= 2`` ranks per stage, and NCCL refuses two ranks on one GPU, so on one
GPU no multi-rank path runs: no split that divides heads, no shard that an all-gather must put back
together, no message between stages. What does run on one rank is every function the runtime calls to
lay a stage out, at degree 1, on the device, over the backend's own collectives:

- ``mesh``: :func:`runtime.executing.mesh.stage_meshes` (``dist.new_group`` and
  ``DeviceMesh.from_group``) for one stage on rank 0, and an all-reduce over each of its groups;
- ``tensor_parallel``: :func:`runtime.executing.tensor_parallel.split_stage` at degree 1 on the
  package's own tensor plan (DTensor weights, Megatron's ``f``/``g`` as all-reduces of one rank);
- ``shard_<level>``: :func:`runtime.job.stage3d.distribute` (FSDP2's ``fully_shard``,
  :mod:`runtime.executing.sharding`) at each shard level, with
  :func:`~runtime.executing.sharding.before_backward` before every backward as the pipeline sets it;
  ``..._split_backward`` as under zb1p and zbv (:func:`~runtime.executing.sharding.reduce_gradients`);
- ``tensor_parallel_shard_full``: both, FSDP2 over DTensor weights on the 2D mesh;
- ``dcp_*``: the DTensor state dict written as the runtime's checkpoint
  (:class:`runtime.checkpoints.step_folders.Saver`, :func:`runtime.checkpoints.train_state.rank_entries`),
  read back (:func:`runtime.checkpoints.read_tensors.read_stage`), loaded into a fresh stage
  (:func:`runtime.checkpoints.train_state.load`) and trained on.

The runtime itself refuses these layouts at degree 1 (a shard level over one copy is an error in
plan.json; a stage neither split nor sharded takes the plain replicated path), so this drives its
functions directly, on the job of a generated package rewritten to one rank, never copies of them.
Each path trains the stage of a one-stage package (``--model``: the llama-shaped config or the MLP
file of the 3D tests) for :data:`STEPS` SGD steps with momentum, :data:`MICRO` microbatches each, and
compares its weights with plain training of the same stage, built the same way, in the same process,
on the same device: within :data:`TOLERANCE` of each tensor's largest value (fp32 1e-5, the suite's
bound; bf16 autocast 1e-2). At degree 1 a split or a shard is the whole tensor, so the two compute
the same operations and on gloo end exactly equal, but for one known difference under bf16: a
row-wise layer's bias is added after its all-reduce, outside the linear, in fp32 where plain
training's ``linear`` adds it in bf16 (the MLP's 4.7e-3).

Untested on CUDA: no session with a GPU has run it yet; its CPU mode runs in the suite
(tests/benchmarks/test_gpu_check.py).

Run:  python benchmarks/gpu_3d_one_rank.py --backend nccl|gloo [--model llama|mlp] --work DIR --out FILE.json
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, run as a script

import torch
from torch import nn

STEPS, MICRO, BATCH, MORE = 4, 4, 8, 2  # MORE: steps trained on after a checkpoint is loaded
SGD = {"lr": 0.05, "momentum": 0.9}
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}
"""Largest weight difference over the tensor's largest value. bf16: autocast computes in 8
significant bits (2**-8 is 3.9e-3), so two runs a rounding apart after a few steps still pass."""
TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class Way:
    """One way the runtime lays a stage out, here at degree 1.

    Attributes:
        name: the path's name in the report.
        tensor: split over the tensor mesh (:func:`runtime.executing.tensor_parallel.split_stage`).
        shard: the FSDP2 shard level (:data:`runtime.packages.layout3d.SHARD_LEVELS`).
        schedule: the job's schedule (zb1p: a split backward, reduced at the step).
        precision: fp32 or bf16 (autocast).
        checkpoint: written, read back and loaded into a fresh stage after training.
    """

    name: str
    tensor: bool = False
    shard: str = "none"
    schedule: str = "1f1b"
    precision: str = "fp32"
    checkpoint: bool = False


WAYS = (
    Way("tensor_parallel", tensor=True),
    Way("tensor_parallel_bf16", tensor=True, precision="bf16"),
    Way("shard_optimizer", shard="optimizer"),
    Way("shard_gradients", shard="gradients"),
    Way("shard_full", shard="full"),
    Way("shard_full_bf16", shard="full", precision="bf16"),
    Way("shard_full_split_backward", shard="full", schedule="zb1p"),
    Way("shard_optimizer_split_backward", shard="optimizer", schedule="zb1p"),
    Way("tensor_parallel_shard_full", tensor=True, shard="full"),
    Way("dcp_tensor_parallel", tensor=True, checkpoint=True),
    Way("dcp_shard_full", shard="full", checkpoint=True),
)
PATHS = ("mesh", *(w.name for w in WAYS))
"""Every path of the report, in the order they run."""


@dataclass(frozen=True)
class Bench:
    """What every path reads: the package, its job, the data, the device, plain training's weights.

    Attributes:
        package: the generated package's folder (a one-stage plan at tensor_parallel 2: it has a
            tensor plan, and its stage's code is the same at any degree).
        pkg: the package imported.
        job: its job (:class:`runtime.packages.job_config.JobConfig`), rewritten per path to rank 0.
        wiring: the stage's inputs, outputs and the loss's input.
        data: the package's synthetic minibatches (seed 0), as a run draws them.
        criterion: the package's loss.
        device: ``cuda:0`` under nccl, else the CPU.
        work: where checkpoints go.
        plain: per precision, plain training's weights after :data:`STEPS` and :data:`STEPS` +
            :data:`MORE` steps (empty until :func:`with_plain`).
        moved: per precision, how far plain training moved the weights in :data:`STEPS` steps (the
            same measure as the error: a comparison with weights that did not move proves nothing).
        noise: per precision, plain training against itself run again (the same measure).
    """

    package: Path
    pkg: ModuleType
    job: Any
    wiring: Any
    data: Any
    criterion: nn.Module
    device: torch.device
    work: Path
    plain: Mapping[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = field(default_factory=dict)
    moved: Mapping[str, float] = field(default_factory=dict)
    noise: Mapping[str, float] = field(default_factory=dict)


MODELS = {
    "llama": "the hf:llama-shaped config of the 3D tests (4 layers, hidden 128, 8 heads, 4 KV heads)",
    "mlp": "the user MLP file of the 3D tests (tests/runtime/mlp3d_model.py: biases, LayerNorm)",
}
"""The models a one-stage package can be made of (``--model``)."""


def make_bench(model: str, work: Path, device: torch.device) -> Bench:
    """A one-stage package of ``model`` (:data:`MODELS`), generated under ``work`` (profiled on the
    CPU: only its graph is used)."""
    from partitioner.profiler import profile as profiler
    from runtime.datasets.minibatches import SyntheticBatches
    from runtime.packages.job_config import load_job
    from runtime.packages.load import import_package, read_wiring
    from tests.runtime.packages3d import LLAMA, config_file, generate_3d

    root = Path(__file__).resolve().parents[1]
    spec = config_file(work, LLAMA) if model == "llama" else f"{root / 'tests/runtime/mlp3d_model.py'}:model"
    profile = profiler.profile_model(spec, batch_size=BATCH, device="cpu", repeats=1)
    package = generate_3d(work / "package", profile, [(2, 1, "none")], "1f1b", MICRO, BATCH)
    pkg, job = import_package(package), load_job(package)
    wiring = read_wiring(pkg, job.stages, job.module_stages)
    data = SyntheticBatches(pkg, wiring.stage_inputs[0], BATCH, seed=0)
    return Bench(package, pkg, job, wiring, data, pkg.criterion().to(device), device, work)


def build(bench: Bench) -> nn.Module:
    """The package's stage 0 as the worker builds it (seed 0: the same weights every time)."""
    from runtime.packages.load import build_stage

    return build_stage(bench.pkg, bench.wiring, 0, bench.job.module_stages, 0, bench.device).train()


def one_rank_job(job: Any, shard: str, schedule: str = "1f1b") -> Any:
    """``job`` on rank 0 alone, its stage laid out ``1 x 1`` at ``shard``: a layout plan.json may not
    hold (a shard level over one copy), made here directly; the runtime's functions take it as any."""
    from runtime.packages.layout3d import StageLayout

    return replace(job, stage_ranks=((0,),), schedule=schedule, layouts=(StageLayout(1, 1, shard),))


def stage_mesh(job: Any, device: torch.device) -> Any:
    """Rank 0's StageMesh of stage 0 by :func:`runtime.executing.mesh.stage_meshes` (a ``1 x 1``
    layout counts as 3D only when it shards, and the mesh depends on ``t`` and ``d`` alone: it is
    made for the ``full`` level)."""
    from runtime.executing.mesh import stage_meshes

    return stage_meshes(one_rank_job(job, "full"), 0, device.type, TIMEOUT)[0]


def minibatch(bench: Bench, module: nn.Module, optimizer: torch.optim.Optimizer, step: int, way: Way) -> None:
    """One minibatch: gradients accumulated over :data:`MICRO` microbatches, each loss scaled by its
    share, FSDP2's switches set before every backward as the pipeline sets them (one copy: its last
    microbatch is the minibatch's), under a split backward reduced before the step."""
    from runtime.executing.sharding import before_backward, reduce_gradients
    from runtime.precision import autocast
    from runtime.schedule import get_schedule

    names, device = bench.wiring.stage_outputs[0], bench.device
    inputs = [t.to(device) for t in bench.data.inputs(step)]
    target = bench.data.targets(step).to(device)
    parts = [t.tensor_split(MICRO) for t in inputs]
    split = get_schedule(way.schedule).split_backward
    for j, y in enumerate(target.tensor_split(MICRO)):
        with autocast(way.precision, device):
            out = module(*(p[j] for p in parts))
            outs = dict(zip(names, (out,) if len(names) == 1 else tuple(out), strict=True))
            loss = bench.criterion(outs[bench.wiring.loss_input], y)
        if way.shard != "none":
            before_backward(module, way.shard, j == MICRO - 1, split)
        (loss * (y.shape[0] / target.shape[0])).backward()
    if way.shard != "none" and split:
        reduce_gradients(module)
    optimizer.step()
    optimizer.zero_grad()


def optimizer_of(module: nn.Module) -> torch.optim.Optimizer:
    """The runtime's optimizer (:func:`runtime.executing.optimizer.make_optimizer`): SGD, momentum."""
    from runtime.executing.optimizer import OptimSettings, make_optimizer

    return make_optimizer(OptimSettings(**SGD), module.parameters())  # type: ignore[arg-type]


def train(
    bench: Bench, module: nn.Module, way: Way, first: int, steps: int,
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.optim.Optimizer:  # fmt: skip
    """``steps`` minibatches from step ``first``; returns the optimizer (to train on with)."""
    optimizer = optimizer or optimizer_of(module)
    for step in range(first, first + steps):
        minibatch(bench, module, optimizer, step, way)
    return optimizer


def whole(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a DTensor gathered), detached, in fp32 on the CPU."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().float().cpu().clone()  # (a copy: on the CPU .float().cpu() is the weight)
    return out


def momenta(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """SGD's momentum buffer of every parameter, whole, by parameter name."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        buf = optimizer.state[p]["momentum_buffer"]
        out[name] = (buf.full_tensor() if isinstance(buf, DTensor) else buf).detach().float().cpu().clone()
    return out


def max_rel_error(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> float:
    """The largest difference of a tensor over its reference's largest value (the suite's criterion).

    Raises:
        ValueError: the two hold different names or shapes (a path that renamed or resized a weight).
    """
    if set(got) != set(want):
        raise ValueError(f"parameters differ: {sorted(set(got) ^ set(want))[:4]}")
    worst = 0.0
    for name, ref in want.items():
        if got[name].shape != ref.shape:
            raise ValueError(f"{name}: shape {list(got[name].shape)}, plain {list(ref.shape)}")
        worst = max(worst, float((got[name] - ref).abs().max()) / (float(ref.abs().max()) or 1.0))
    return worst


def max_abs(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> float:
    """The largest absolute difference (a round trip must be exact).

    Raises:
        ValueError: the two hold different names.
    """
    if set(got) != set(want):
        raise ValueError(f"tensors differ: {sorted(set(got) ^ set(want))[:4]}")
    return max((float((got[k] - want[k]).abs().max()) for k in want), default=0.0)


def verdict(error: float, precision: str) -> str:
    return "equal" if error <= TOLERANCE[precision] else "DIFFERENT"


def with_plain(bench: Bench, precisions: set[str]) -> Bench:
    """``bench`` with plain training's weights after :data:`STEPS` and :data:`MORE` more, per
    precision; how far they moved from the start; and plain training run again, the noise floor
    (0 where the device's kernels are deterministic, as on one CPU thread; on a GPU atomics in some
    backward kernels may leave a trace)."""
    plain, moved, noise, initial = {}, {}, {}, whole(build(bench))
    for precision in sorted(precisions):
        module, way = build(bench), Way("plain", precision=precision)
        optimizer = train(bench, module, way, 0, STEPS)
        first = whole(module)
        train(bench, module, way, STEPS, MORE, optimizer)
        plain[precision], moved[precision] = (first, whole(module)), max_rel_error(first, initial)
        again = build(bench)
        train(bench, again, way, 0, STEPS)
        noise[precision] = max_rel_error(whole(again), first)
    return replace(bench, plain=plain, moved=moved, noise=noise)


def laid_out(bench: Bench, way: Way) -> tuple[nn.Module, dict[str, Any]]:
    """The stage laid out as ``way`` says by the runtime's own functions, and what they made."""
    from torch.distributed.tensor import DTensor

    from runtime.executing.tensor_parallel import read_plan, split_stage
    from runtime.job.stage3d import distribute
    from runtime.settings.run_options import RunOptions

    module, facts = build(bench), dict[str, Any]()
    mesh = stage_mesh(bench.job, bench.device)
    if way.tensor:
        split = split_stage(module, read_plan(bench.package), mesh.mesh["tensor"], mesh.tensor, 0, 0)
        facts["layers_split"] = len(split)
        if not split:
            raise RuntimeError("the tensor plan split no layer of the stage")
    if way.shard != "none":
        cfg = one_rank_job(bench.job, way.shard, way.schedule).for_rank(0)
        module = distribute(module, cfg, mesh, RunOptions(str(bench.package)))
        facts["fsdp_module"] = type(module).__name__
    facts["dtensor_params"] = sum(isinstance(p, DTensor) for p in module.parameters())
    if not facts["dtensor_params"]:
        raise RuntimeError("no parameter became a DTensor")
    return module, facts


def run_way(bench: Bench, way: Way) -> dict[str, Any]:
    """Train the laid-out stage against plain training; with ``checkpoint``, its DCP round trip too."""
    module, facts = laid_out(bench, way)
    optimizer = train(bench, module, way, 0, STEPS)
    error = max_rel_error(whole(module), bench.plain[way.precision][0])
    row = {
        **facts,
        "precision": way.precision,
        "max_rel_error": error,
        "result": verdict(error, way.precision),
    }
    if way.checkpoint:
        row.update(round_trip(bench, way, module, optimizer))
        exact = row["written_max_abs"] == 0 and row["loaded_max_abs"] == 0
        worst = max(error, row["resumed_max_rel_error"])
        row["result"] = verdict(worst, way.precision) if exact else "DIFFERENT"
    return row


def round_trip(bench: Bench, way: Way, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The trained stage written as the runtime's step folder, read back, loaded into a fresh stage
    laid out the same way (weights and momenta exact), and trained :data:`MORE` steps on."""
    import torch.distributed as dist

    from runtime.checkpoints import resume_settings, train_state
    from runtime.checkpoints.read_tensors import read_stage
    from runtime.checkpoints.step_folders import Saver, step_dir
    from runtime.packages.tensor_names import model_names
    from runtime.settings.run_options import RunOptions

    job, root = one_rank_job(bench.job, way.shard, way.schedule), bench.work / f"ckpt-{way.name}"
    shutil.rmtree(root, ignore_errors=True)  # (a kit run again in the same --work)
    options = RunOptions(str(bench.package), checkpoint_dir=str(root))
    names = model_names(bench.pkg, job)
    group = dist.new_group(backend="gloo", timeout=TIMEOUT)  # as RankCheckpoints.open makes it
    saver = Saver(root, 0, group, resume_settings.record(options, job, STEPS + MORE, names))
    held = [train_state.Held(0, module, optimizer)]
    saver.save(STEPS, train_state.rank_entries(names, held, 0, STEPS, None, None))
    saver.close()
    trained = whole(module)
    written = read_stage(root, STEPS, 0, bench.package)
    fresh, _ = laid_out(bench, way)
    fresh_opt = optimizer_of(fresh)
    into = [train_state.Held(0, fresh, fresh_opt)]
    step, _ = train_state.load(step_dir(root, STEPS), names, into, 0, group, None, None, rng=False)
    weights = max_abs(whole(fresh), trained)
    loaded = max(weights, max_abs(momenta(fresh, fresh_opt), momenta(module, optimizer)))
    train(bench, fresh, way, STEPS, MORE, fresh_opt)
    return {
        "checkpoint_step": step,
        "written_max_abs": max_abs({k: v.float() for k, v in written.items() if k in trained}, trained),
        "loaded_max_abs": loaded,
        "resumed_max_rel_error": max_rel_error(whole(fresh), bench.plain[way.precision][1]),
    }


def run_mesh(job: Any, device: torch.device) -> dict[str, Any]:
    """The stage's mesh on one rank: its shape and names, and a collective over each of its groups."""
    import torch.distributed as dist

    mesh = stage_mesh(job, device)
    sums = []
    for group in (mesh.data, mesh.tensor):
        one = torch.ones(1, device=device)
        dist.all_reduce(one, group=group)
        sums.append(float(one))
    row = {
        "mesh_shape": list(mesh.mesh.shape),
        "dims": list(mesh.mesh.mesh_dim_names),
        "group_sizes": [dist.get_world_size(mesh.data), dist.get_world_size(mesh.tensor)],
        "all_reduce": sums,
    }
    good = row["mesh_shape"] == [1, 1] and row["dims"] == ["data", "tensor"] and sums == [1.0, 1.0]
    return {**row, "result": "built" if good else "WRONG"}


def recorded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn``'s row with ``ran`` and its wall time; a failure recorded with its error (the rest go on)."""
    started = time.perf_counter()
    try:
        row = {"ran": True, **fn()}
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        row = {"ran": False, "result": "error", "error": f"{type(exc).__name__}: {exc}",
               "at": f"{Path(where.filename).name}:{where.lineno}"}  # fmt: skip
    row["wall_s"] = round(time.perf_counter() - started, 2)
    return row


def _write(out: Path, report: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


def run_all(backend: str, model: str, work: Path, out: Path, only: set[str] | None = None) -> dict[str, Any]:
    """Every path on this one process, the report rewritten after each (a run cut short keeps what
    it measured; ``running`` names the path a timeout stopped)."""
    import torch.distributed as dist

    device = torch.device("cuda:0" if backend == "nccl" else "cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    report: dict[str, Any] = {
        "schema": "pipeplan.gpu_3d_one_rank/1", "backend": backend, "device": str(device),
        "torch": torch.__version__, "world_size": 1, "model": model,
        "steps": STEPS, "microbatches": MICRO, "batch_size": BATCH, "sgd": SGD, "tolerance": TOLERANCE,
        "paths": {},
    }  # fmt: skip
    (work / "store").unlink(missing_ok=True)  # a FileStore left by an earlier run would not rendezvous
    store = f"file://{work / 'store'}"
    try:
        dist.init_process_group(backend, init_method=store, rank=0, world_size=1, timeout=TIMEOUT)
    except Exception as exc:
        report["error"] = f"joining a process group of one: {type(exc).__name__}: {exc}"
        _write(out, report)
        return report
    try:
        _paths(report, model, work, out, only)
    finally:
        _write(out, report)
        dist.destroy_process_group()
    return report


def _paths(report: dict[str, Any], model: str, work: Path, out: Path, only: set[str] | None) -> None:
    """Fill ``report["paths"]``; what fails before any path runs (the package, plain training) is
    the report's ``error``."""
    device = torch.device(report["device"])
    ways = [w for w in WAYS if only is None or w.name in only]
    try:
        report["running"], started = "making the package", time.perf_counter()
        bench = make_bench(model, work, device)
        report["package_s"] = round(time.perf_counter() - started, 2)
        report["paths"]["mesh"] = recorded(lambda: run_mesh(bench.job, device))
        report["running"], started = "plain training", time.perf_counter()
        _write(out, report)
        bench = with_plain(bench, {w.precision for w in ways})
        report["plain_moved"], report["plain_noise"] = dict(bench.moved), dict(bench.noise)
        report["plain_s"] = round(time.perf_counter() - started, 2)
    except Exception as exc:
        report["error"] = f"{report.pop('running')}: {type(exc).__name__}: {exc}"
        return
    for way in ways:
        report["running"] = way.name
        _write(out, report)
        report["paths"][way.name] = recorded(functools.partial(run_way, bench, way))
    report.pop("running")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    parser.add_argument("--model", choices=tuple(MODELS), default="llama", help="the stage's model [llama]")
    parser.add_argument("--work", type=Path, default=None, help="package, checkpoints [a temp folder]")
    parser.add_argument("--out", type=Path, required=True, help="the report (JSON)")
    parser.add_argument("--only", default=None, help="comma-separated path names [all]")
    args = parser.parse_args(argv)
    if args.backend == "nccl" and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --backend gloo")
    only = set(args.only.split(",")) if args.only else None
    unknown = sorted((only or set()) - {w.name for w in WAYS})
    if unknown:
        parser.error(f"unknown paths {unknown}; choose from {', '.join(w.name for w in WAYS)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="pipeplan-3d-one-rank-"))
    work.mkdir(parents=True, exist_ok=True)
    run_all(args.backend, args.model, work.resolve(), args.out, only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
