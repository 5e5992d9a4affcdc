"""``pipeplan partition`` as one library call: a profile and a cluster -> a written package.

The request is checked in the order a user would fix it (the profile, the options that cannot apply,
the cluster, the memory, the schedule's own rules), then solved (one schedule, ``auto`` over all,
or the user's fixed ``cuts``), checked once more as a plan, written and simulated. Remarks that are
no errors (the memory assumed for an estimated device, stage code left out of a big model) go to
``note`` as they arise; :class:`Partitioned` carries everything the command prints.

Example:
    >>> done = partition(PartitionRequest(gpus=4, output="models"))  # doctest: +SKIP
    >>> done.out_dir, done.plan.predicted.time_per_minibatch_s
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from partitioner.errors import InfeasibleError, PlanError, ProfileFormatError
from partitioner.generation.overwrite import check_replace
from partitioner.graph import Profile, load_profile
from partitioner.hardware.clusters import default_latency, levels_of, load_cluster
from partitioner.hardware.devices import estimated_device
from partitioner.optimizer import evaluate, solve
from partitioner.optimizer.auto import AUTO_SCHEDULES, AutoChoice, solve_auto
from partitioner.optimizer.layouts import (
    LAYOUT_SCHEDULES,
    check_tensor,
    hand_layouts,
    simulate_layout,
    solve_layouts,
    splits,
)
from partitioner.optimizer.options import (
    SolveOptions,
    check_devices,
    check_microbatches,
    default_microbatches,
)
from partitioner.optimizer.planner import alternatives
from partitioner.optimizer.pricing.price import check_layers_fit
from partitioner.optimizer.pricing.schedules import model as schedule_model
from partitioner.optimizer.pricing.simulate import (
    Simulation,
    with_stage_bubbles,
    write_chrome_trace,
)
from partitioner.optimizer.units import parse_bytes, parse_int_list
from partitioner.plan import Cluster, Plan, mp_conf, save_plan
from partitioner.profiler.update_cost import with_update_time
from runtime.files.atomic import write_text_atomic
from runtime.files.find_newest import newest
from runtime.schedule import get_schedule

__all__ = ["PartitionRequest", "Partitioned", "cluster_of", "microbatch_note", "newest_profile", "partition"]


@dataclass(frozen=True)
class PartitionRequest:
    """What ``pipeplan partition`` was asked, by its options' names (None: not given)."""

    profile_path: str | None = None
    gpus: int | None = None
    cluster_spec: str | None = None
    topology: str | None = None
    bandwidth: str | None = None
    latency: str | None = None
    memory: str | None = None
    host_cores: int | None = None
    schedule: str = "auto"
    microbatches: int | None = None
    virtual: int | None = None
    optimizer: str = "sgd"
    straight: bool = False
    recompute: str | None = None
    solver: str = "dp"
    cuts: str | None = None
    replicas: str | None = None
    tensor_parallel: int | None = None
    shard: str | None = None
    explain: bool = False
    trace_path: str | None = None
    batch_size: int | None = None
    no_comm: bool = False
    weights: str | None = None
    init: str = "auto"
    output: str = "models"
    force: bool = False


@dataclass(frozen=True)
class Partitioned:
    """A written plan and what its output shows: the profile it was priced on (with the update
    time), the cluster, the simulation, ``auto``'s choice, ``--explain``'s baselines, and the runs of
    the plan it replaced that the package folder now keeps (``runs.<time>``: newly moved, by name)."""

    plan: Plan
    profile: Profile
    cluster: Cluster
    simulation: Simulation
    out_dir: Path
    recompute: str
    choice: AutoChoice | None = None
    alternatives: dict[str, Plan | None] | None = None
    kept_runs: tuple[str, ...] = ()


def partition(request: PartitionRequest, note: Callable[[str], None] = lambda _: None) -> Partitioned:
    """Check, solve, write and simulate one request (see the module's docstring)."""
    r = request
    path = Path(r.profile_path) if r.profile_path else newest_profile()
    profile = load_profile(path)
    if r.batch_size is not None:
        if r.batch_size < 1:
            raise PlanError(f"--batch-size must be >= 1, got {r.batch_size}")
        profile = replace(profile, batch_size=r.batch_size)
    _check_package_options(profile, r.weights, r.init)
    if profile.precision == "fp16" and r.schedule != "auto" and get_schedule(r.schedule).stashes:
        raise PlanError(
            f"{path} was measured at fp16, whose loss scaling needs a synchronous schedule: partition with "
            "--schedule 1f1b or gpipe, or profile with --precision bf16 for pipedream"
        )
    profile = with_update_time(profile, r.optimizer)
    recompute = r.recompute or ("auto" if r.schedule == "auto" else "none")  # auto searches it too
    asked = cluster_of(r.gpus, r.topology, r.bandwidth, r.memory, r.cluster_spec, r.latency, profile.device)
    cluster = cpu_hosts(asked, profile, r.host_cores)
    check_devices(profile, cluster.gpus)
    cluster = _estimated_memory(profile, cluster, note)
    if cluster.memory_bytes is not None:
        check_layers_fit(profile, cluster.memory_bytes, r.optimizer)
    v = virtual_stages(r.schedule, r.virtual, r.explain)
    plan, choice, micro = _solve(r, profile, cluster, recompute, v)
    schedule = plan.schedule if choice is not None or "layout" in plan.extra else r.schedule
    check_replicas(plan)
    check_microbatches(profile, plan.schedule, plan.microbatches)  # (after the schedule's own checks)
    plan = replace(plan, profile=str(path), precision=profile.precision)
    name = profile.model if profile.tracer == "pipedream" else _model_name(profile.model)
    out_dir = Path(r.output) / re.sub(r"[^A-Za-z0-9_.-]+", "_", name or "model") / f"gpus={cluster.gpus}"
    check_replace(out_dir, plan, r.force)  # (the package a run came from is not replaced by surprise)
    before = _kept_runs(out_dir)
    sim = simulate_layout(plan, profile)
    plan = _write_plan(profile, with_stage_bubbles(plan, sim), out_dir, r.weights, r.init, note)
    kept = tuple(sorted(_kept_runs(out_dir) - before))
    if r.trace_path:
        write_chrome_trace(sim, r.trace_path)
    laid = schedule_model(schedule).laid_out and "layout" in plan.extra  # (no laid-out baselines)
    explained = r.explain and not laid
    others = alternatives(profile, cluster, schedule, micro, r.optimizer, recompute) if explained else None
    if r.explain and laid:  # --explain's layouts only
        others = {}
    if others is not None and (choice is not None or "layout" in plan.extra):
        others = {**hand_layouts(profile, cluster, _options(r, recompute), choice), **others}
    return Partitioned(plan, profile, cluster, sim, out_dir, recompute, choice, others, kept)


def _solve(
    r: PartitionRequest, profile: Profile, cluster: Cluster, recompute: str, v: int
) -> tuple[Plan, AutoChoice | None, int]:
    """The plan (one schedule's best, ``auto``'s choice, or the user's cuts), ``auto``'s choice, and
    the microbatch count asked of the baselines."""
    if r.microbatches is not None:
        micro = r.microbatches
    else:  # (auto tries several counts; 4 is where it starts)
        micro = (
            4 if r.schedule == "auto" else schedule_model(r.schedule).default_microbatches(cluster.gpus, v)
        )
        micro = default_microbatches(profile.batch_size, micro)  # the largest up to it that splits the batch
    if (r.cuts is None) != (r.replicas is None):
        raise PlanError("--cuts and --replicas go together: give both, or neither")
    if len(profile.layers) < 1:
        raise PlanError("the profile has no layers")
    if r.cuts is not None and r.schedule == "auto":
        raise PlanError(
            "--cuts fixes the plan, so there is nothing for --schedule auto to choose: name a schedule"
        )
    comm = not r.no_comm
    if r.cuts is not None and r.replicas is not None:
        layers = [c.strip() for c in r.cuts.split(",") if c.strip()]
        counts = parse_int_list(r.replicas, "--replicas")
        plan = evaluate(profile, cluster, layers, counts, r.schedule, micro, r.optimizer, comm, recompute, v)
        return plan, None, micro
    if _fixed_layout(r):
        return _solve_3d(r, profile, cluster, recompute), None, micro
    if r.schedule == "auto":
        names = [s for s in AUTO_SCHEDULES if not (get_schedule(s).stashes and profile.precision == "fp16")]
        opts = SolveOptions("auto", r.microbatches or 4, r.optimizer, r.straight, r.solver, comm, recompute)
        counts_ = (r.microbatches,) if r.microbatches else None
        choice = solve_auto(profile, cluster, opts, names, counts=counts_)
        if not r.straight and splits(profile, cluster):  # (docs/layout-3d.md: the 3D search too)
            best = solve_layouts(profile, cluster, opts, microbatches=r.microbatches,
                                 incumbent=choice.plan.predicted.time_per_minibatch_s)  # fmt: skip
            if best is not None:
                return best.plan, choice, choice.plan.microbatches
        return choice.plan, choice, choice.plan.microbatches
    plan = solve(profile, cluster, r.schedule, micro, r.optimizer, r.straight, r.solver, comm, recompute, v)
    return plan, None, micro


def _fixed_layout(r: PartitionRequest) -> bool:
    """Whether --tensor-parallel or --shard asks for a 3D layout (1 and none: today's plans)."""
    return (r.tensor_parallel or 1) > 1 or (r.shard or "none") != "none"


def _options(r: PartitionRequest, recompute: str) -> SolveOptions:
    return SolveOptions("1f1b", r.microbatches or 4, r.optimizer, True, r.solver, not r.no_comm, recompute)


def _solve_3d(r: PartitionRequest, profile: Profile, cluster: Cluster, recompute: str) -> Plan:
    """The plan of the layout --tensor-parallel and --shard fix for every stage (the rest searched)."""
    if r.cuts is not None or r.straight:
        raise PlanError("--tensor-parallel and --shard search the cuts: drop --cuts, --replicas, --straight")
    if r.schedule != "auto" and schedule_model(r.schedule).asynchronous:
        raise PlanError(f"--schedule {r.schedule} takes no tensor parallelism or sharding")
    if r.tensor_parallel:
        check_tensor(profile, cluster, r.tensor_parallel)
    copies = cluster.gpus // (r.tensor_parallel or 1)
    if r.shard not in (None, "none") and copies < 2:
        raise PlanError(
            f"--shard {r.shard} shards over a stage's data-parallel copies, and {cluster.gpus} GPU(s) at "
            f"--tensor-parallel {r.tensor_parallel or 1} leave none: give more GPUs or drop --shard"
        )
    schedules = LAYOUT_SCHEDULES if r.schedule == "auto" else (r.schedule,)
    best = solve_layouts(profile, cluster, _options(r, recompute), schedules, r.tensor_parallel,
                         r.shard, r.microbatches)  # fmt: skip
    if best is None:
        gpus = cluster.gpus
        where = f"fits in {gpus} GPUs' memory" if cluster.memory_bytes else f"runs on {gpus} GPUs"
        raise InfeasibleError(f"no plan with --tensor-parallel {r.tensor_parallel or 'any'} and --shard "
                              f"{r.shard or 'any'} {where}")  # fmt: skip
    return best.plan


def newest_profile() -> Path:
    """The profile ``partition`` plans from when given none: the newest under ./profiles."""
    missing = ProfileFormatError(
        "no profiles/*/profile.json here; run `pipeplan profile MODEL` or give --profile"
    )
    return newest("profiles", "*/profile.json", missing)


def cluster_of(
    gpus: int | None, topology: str | None, bandwidth: str | None, memory: str | None,
    preset: str | None = None, latency: str | None = None, device: str = "cpu",
) -> Cluster:  # fmt: skip
    """The devices asked: ``--gpus N`` or ``--topology N1,N2`` with ``--bandwidth`` and ``--latency``
    (default: ``clusters.default_latency`` of the profile's ``device``), or a named preset."""
    if preset is not None:
        if gpus is not None or topology is not None or bandwidth is not None or latency is not None:
            raise PlanError(
                "--cluster gives the devices and their links: drop --gpus, --topology, --bandwidth, --latency"
            )
        cluster = load_cluster(preset)
        return replace(cluster, memory_bytes=parse_bytes(memory)) if memory else cluster
    if (gpus is None) == (topology is None):
        raise PlanError("give exactly one of --gpus N, --topology N1,N2,.. or --cluster NAME[:NODES]")
    if gpus is not None and gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {gpus}")
    devices = [gpus] if gpus is not None else parse_int_list(str(topology), "--topology")
    limit = parse_bytes(memory) if memory else None
    return Cluster(levels_of(devices, bandwidth, latency, default_latency(device)), limit)


def _estimated_memory(profile: Profile, cluster: Cluster, note: Callable[[str], None]) -> Cluster:
    """A profile estimated for a device model plans with that device's memory unless told otherwise."""
    device = estimated_device(profile)
    if device is None or cluster.memory_bytes is not None:
        return cluster
    note(
        f"--memory {device.memory_bytes / 2**30:.0f}GiB, the memory of the "
        f"{device.name} the profile was estimated for (give --memory to plan for another)"
    )
    return replace(cluster, memory_bytes=device.memory_bytes)


def cpu_hosts(cluster: Cluster, profile: Profile, host_cores: int | None) -> Cluster:
    """CPU ranks time-slice their host's cores: a CPU profile's cluster gets this machine's cores (or
    --host-cores) and the threads the profile measured with, so the prediction counts the sharing."""
    if profile.device != "cpu":
        if host_cores is not None:
            raise PlanError(
                f"--host-cores is for profiles measured on a CPU; this one was measured on "
                f"{profile.device}, whose devices compute on their own: leave --host-cores out"
            )
        return cluster
    if host_cores is not None and host_cores < 0:
        raise PlanError(f"--host-cores must be >= 0 (0: every rank has cores of its own), got {host_cores}")
    cores = len(os.sched_getaffinity(0)) if host_cores is None else host_cores
    threads = int(profile.extra.get("threads") or 1)
    return replace(cluster, cores=cores or None, threads=max(1, threads))


def _check_package_options(profile: Profile, weights: str | None, init: str) -> None:
    """Refuse --weights/--init that cannot apply before solving, not after."""
    if profile.tracer == "pipedream" and (weights is not None or init != "auto"):
        raise PlanError(
            "--weights and --init need a traced model; a PipeDream graph.txt profile yields only the plan"
        )
    if weights is not None and not Path(weights).is_file():
        raise PlanError(f"--weights {weights}: no such file; give a torch.save(model.state_dict()) file")


def virtual_stages(schedule: str, virtual: int | None, explain: bool) -> int:
    """--virtual-stages: 2 by default under interleaved, refused elsewhere (and --explain, whose
    baselines are not laid out in virtual stages)."""
    laid_out = schedule != "auto" and schedule_model(schedule).laid_out
    asks = laid_out and schedule_model(schedule).virtual_stages is None  # (as many as asked: interleaved)
    if laid_out and explain and not asks:
        raise PlanError(f"--explain does not support --schedule {schedule} yet; drop one of them")
    if not asks:
        if virtual is not None:
            raise PlanError(f"--virtual-stages needs --schedule interleaved, not {schedule}")
        return 1
    if virtual is not None and virtual < 1:
        raise PlanError(f"--virtual-stages must be >= 1, got {virtual}")
    if explain:
        raise PlanError(f"--explain does not support --schedule {schedule} yet; drop one of them")
    return 2 if virtual is None else virtual


def check_replicas(plan: Plan) -> None:
    """Refuse a plan whose replicas cannot all get a sample: the cost model divides a minibatch's time
    by the replicas as if samples were endlessly divisible (100000 GPUs at batch 8: "97742x"). The
    search caps replicas at the samples, so such a plan leaves GPUs idle: refused too."""
    widest = max(plan.stages, key=lambda s: s.replicas)
    if plan.batch_size and widest.replicas > plan.batch_size:
        raise PlanError(
            f"the plan gives stage {widest.index} {widest.replicas} replicas but a minibatch has only "
            f"{plan.batch_size} samples; use fewer --gpus, --straight, or profile a larger --batch-size"
        )
    if plan.batch_size and widest.replicas == plan.batch_size and plan.gpus < plan.cluster.gpus:
        raise PlanError(  # the search caps replicas at the samples: GPUs beyond would sit idle
            f"a minibatch of {plan.batch_size} samples gives work to {plan.gpus} of the "
            f"{plan.cluster.gpus} GPUs; use --gpus {plan.gpus}, or profile a larger --batch-size"
        )


def _write_plan(
    profile: Profile, plan: Plan, out_dir: Path, weights: str | None, init: str, note: Callable[[str], None]
) -> Plan:
    """The package (stage code, plan.json, mp_conf.json); only the plan where no code can be written."""
    if profile.tracer == "pipedream":  # (no model: only the plan; torch is not even imported)
        too_big = None
    else:
        from partitioner.profiler.budget import unbuildable

        too_big = unbuildable(profile)
    if profile.tracer != "pipedream" and too_big is None:
        from partitioner.generation.codegen import write_package  # (torch: only where code is written)

        return write_package(profile, plan, out_dir, Path(weights) if weights else None, init)
    if too_big and (weights or init != "auto"):
        raise PlanError(f"--weights and --init shape the stage code, which is not written: {too_big}")
    if too_big:
        note(f"stage code not written, only plan.json and mp_conf.json: {too_big}")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_plan(plan, out_dir / "plan.json")
    write_text_atomic(out_dir / "mp_conf.json", json.dumps(mp_conf(plan.stages), indent=1) + "\n")
    return plan


def _model_name(spec: str) -> str:
    """:func:`partitioner.models.specs.model_name` (models brings torch: imported for traced profiles
    only)."""
    from partitioner.models.specs import model_name

    return model_name(spec)


def _kept_runs(out_dir: Path) -> set[str]:
    """The runs of replaced plans ``out_dir`` keeps (:func:`partitioner.generation.codegen.kept_runs`; codegen
    is imported only where the folder has runs: a graph.txt profile's plan never needs it)."""
    if not any(out_dir.glob("run*")):
        return set()
    from partitioner.generation.codegen import kept_runs

    return kept_runs(out_dir)


def microbatch_note(profile: Profile, plan: Plan) -> str | None:
    """Say when layer times measured at one batch size are divided into microbatches of another (not
    when the profile measured fixed per-call times: the cost model then charges each microbatch its own)."""
    measured = profile.extra.get("measured_batch_size", profile.batch_size)
    if get_schedule(plan.schedule).stashes or not profile.batch_size or profile.tracer == "pipedream":
        return None
    if any(n.forward_fixed_ms or n.backward_fixed_ms for n in profile.nodes):
        return None
    micro = profile.batch_size / plan.microbatches
    if measured == micro:
        return None
    return (
        f"layer times measured at {measured} samples are scaled to microbatches of {micro:g}; small "
        f"batches cost more per sample, so for this plan profile with --batch-size {profile.batch_size} "
        f"--microbatch-size {max(1, int(micro))}"
    )
