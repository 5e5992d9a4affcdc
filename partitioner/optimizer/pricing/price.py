"""Turn a list of stages (node sets + replicas + ranks) into a costed ``Plan``: shared by the solvers,
``evaluate`` and the baselines, so that every plan is priced by one model."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Node, Profile
from partitioner.optimizer.pricing.device_memory import StageBytes, walked_peak
from partitioner.optimizer.pricing.memory import (
    allreduce_bytes,
    backward_excess,
    copy_bytes,
    made_at_once,
    master_ratio,
    peak_bytes,
    persistent_factor,
    shared_weights,
    transient_bytes,
)
from partitioner.optimizer.pricing.schedules import model, plan_times, with_actions
from partitioner.optimizer.pricing.stage import (
    W_SHARE,
    StageLoad,
    StagePrice,
    StageTimes,
    allreduce_time,
    host_bound,
    stage_time,
)
from partitioner.plan import Cluster, Link, Plan, Prediction, SolverInfo, Stage
from runtime.schedule import Action, Layout, build

__all__ = [
    "RECOMPUTE_MODES",
    "StageSpec",
    "assemble",
    "backward_item",
    "data_parallel_time",
    "device_shares",
    "gib",
    "global_lower_bound",
    "held_added",
    "held_backward",
    "held_memory",
    "held_working",
    "hosts_bound",
    "laid_out_peaks",
    "layer_compute_s",
    "price_stage",
    "stage_link",
    "stage_loads",
    "stage_memory",
    "stage_transient",
]

#: ``none``: every stage keeps its activations; ``all``: every stage recomputes; ``auto``: a stage
#: recomputes only where it does not fit the memory limit otherwise.
RECOMPUTE_MODES = ("none", "all", "auto")


@dataclass(frozen=True)
class StageSpec:
    """A stage before costing: which layers, how many replicas, on which ranks."""

    nodes: tuple[str, ...]
    replicas: int
    ranks: tuple[int, ...]


def gib(nbytes: float) -> str:
    """Bytes as a short human string: two decimals in GiB, or in MiB / KiB for amounts that would
    read 0.00 GiB (a limit of 1 KiB must not be told that "0.00 GiB" would fit)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size / 10:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


def check_layers_fit(profile: Profile, limit: float, optimizer: str) -> None:
    """A PlanError naming the largest layer that no device can hold: its weights, gradients, master
    copy and optimizer state alone exceed ``limit`` (a pipeline cuts between layers, never inside
    one, and replicas each hold the whole layer), with its bytes and the device memory."""
    master = master_ratio(profile.dtype)
    factor = persistent_factor(optimizer, master)
    worst = max(profile.layers, key=lambda n: n.param_bytes, default=None)
    if worst is None or worst.param_bytes * factor <= limit:
        return
    raise PlanError(
        f"layer {worst.name} needs {gib(worst.param_bytes * factor)} for its {gib(worst.param_bytes)} of "
        f"{profile.dtype} weights with their gradients" + (", float32 master copy" if master else "")
        + f" and {optimizer} state, more than a device's {gib(limit)}: no plan can hold it (a pipeline "
        "splits a model between layers); raise --memory, or use a lighter --optimizer"
    )  # fmt: skip


def stage_loads(profile: Profile, groups: Sequence[Sequence[str]], posted: bool = False) -> list[StageLoad]:
    """Per-stage compute, parameters, saved activations, tied copies and cut traffic; inputs are free.

    A stage receives everything crossing the cut before it and sends everything crossing the cut
    after it (tensors skipping a stage are relayed through it, as in PipeDream's runtime).
    ``posted``: the ranks post each receive one receiving action ahead (CPU ranks, ``Cluster.cores``).
    """
    where = {nid: i for i, group in enumerate(groups) for nid in group}
    nodes = {n.id: n for n in profile.nodes}
    order = {n.id: i for i, n in enumerate(profile.nodes)}
    last_reader: dict[str, int] = {}
    for node in profile.nodes:
        for src in node.inputs:
            if node.id in where:
                last_reader[src] = max(last_reader.get(src, -1), where[node.id])
    crossing = [0.0] * (len(groups) + 1)  # crossing[c]: bytes over the cut before stage c
    sent = [0.0] * (len(groups) + 1)  # of those, what the producer's backward does not keep
    kept = [0.0] * (len(groups) + 1)  # and what it keeps (both 0 where not measured)
    taken = [0.0] * len(groups)  # taken[c]: bytes stage c's forward takes, the model's inputs too
    for src, reader in last_reader.items():
        node = nodes[src]
        if src not in where:
            continue
        first = 0 if node.op == "input" else where[src] + 1
        for cut in range(first, reader + 1):
            taken[cut] += node.output_bytes
            crossing[cut] += node.output_bytes if node.op != "input" else 0.0
            if node.op != "input" and node.kept_output_bytes is not None:
                sent[cut] += node.output_bytes - node.kept_output_bytes
                kept[cut] += node.kept_output_bytes
    loads = []
    copies = copy_bytes(shared_weights(profile), groups)
    master = master_ratio(profile.dtype)
    for i, group in enumerate(groups):
        members = sorted((nodes[n] for n in group if nodes[n].op != "input"), key=lambda n: order[n.id])
        largest = max([made_at_once(n) for n in members] + [copies[i][1]])
        loads.append(
            StageLoad(
                compute_s=math.fsum(n.compute_ms for n in members) / 1000.0,
                param_bytes=float(sum(n.param_bytes for n in members)),
                saved_bytes=float(sum(n.saved_bytes for n in members)),
                in_bytes=crossing[i],
                out_bytes=crossing[i + 1],
                forward_s=math.fsum(n.forward_ms for n in members) / 1000.0,
                input_bytes=taken[i],
                copy_bytes=copies[i][0],
                largest_param_bytes=largest,
                master=master,
                working_bytes=backward_excess(
                    [(float(n.working_bytes), float(n.saved_bytes)) for n in members], crossing[i + 1]
                ),
                deferred_bytes=float(sum(n.deferred_bytes for n in members)) if i else crossing[i + 1],
                kept_bytes=float(sum(n.saved_bytes for n in members if n.op == "output")),
                sent_bytes=sent[i + 1],
                received_bytes=kept[i],
                posted_bytes=max(crossing[i], crossing[i + 1]) if posted else 0.0,
                weight_s=_weight_s(members, first=i == 0),
            )
        )
    return loads


def _weight_s(members: Sequence[Node], first: bool) -> float | None:
    """A stage's W seconds under a split backward, from its layers' measured (B, W): their Ws, or on
    the first stage its whole backward (``runtime.executing.split_backward``: with no input gradient to make,
    B does nothing and W runs the backward); None where no layer was timed so."""
    if not any(n.split_ms for n in members):
        return None
    if first:
        return math.fsum(n.backward_ms for n in members) / 1000.0
    return math.fsum(n.split_ms[1] if n.split_ms else n.backward_ms * W_SHARE for n in members) / 1000.0


def stage_link(cluster: Cluster, ranks: Sequence[int], neighbours: Sequence[int]) -> Link:
    """Link of the smallest hierarchy level holding a stage's ranks and its neighbours' ranks."""
    span = 1
    link = cluster.levels[0].link
    everything = list(ranks) + list(neighbours)
    for level in cluster.levels:
        if len({r // span for r in everything}) <= 1:
            return link
        link = level.link
        span *= level.devices
    return link


def layer_compute_s(profile: Profile) -> float:
    """Forward+backward seconds of every node but the inputs (free: PipeDream zeroes them)."""
    return math.fsum(n.compute_ms for n in profile.nodes if n.op != "input") / 1000.0


def data_parallel_time(
    profile: Profile, cluster: Cluster, schedule: str = "pipedream", microbatches: int = 1
) -> float:
    """Data parallelism on every device: PipeDream's comparator (each level replicates the whole
    model), or for synchronous schedules the compute split M ways plus one all-reduce over the
    slowest level; the one stage's actions at the cluster's ``action_s`` each, as any stage's."""
    time = layer_compute_s(profile) + cluster.action_for(schedule) * model(schedule).actions(microbatches)
    params = float(sum(n.param_bytes for n in profile.nodes if n.op != "input"))
    if not model(schedule).asynchronous:
        return time / cluster.gpus + allreduce_time(params, cluster.gpus, cluster.slowest)
    inner = 1
    for level in cluster.levels:
        time = float(stage_time(time, params, level.devices, level.link, inner))
        inner = level.devices
    return time


def hosts_bound(cluster: Cluster, stages: Sequence[Stage], actions: int = 0, schedule: str = "") -> float:
    """:func:`~partitioner.optimizer.pricing.schedules.host_bound` of a plan's stages: a replica computes its
    share of the minibatches, ``compute_s / replicas`` per minibatch, and runs its share of a stage's
    ``actions`` (``ScheduleModel.actions``) at the cluster's time per action under ``schedule`` each
    (:meth:`Cluster.action_for`): Python on its cores too."""
    rank_s, action_s = [0.0] * cluster.gpus, cluster.action_for(schedule)
    for stage in stages:
        for rank in stage.ranks:
            rank_s[rank] += (stage.compute_s + actions * action_s) / stage.replicas
    return host_bound(rank_s, cluster.levels[0].devices, cluster.cores, cluster.threads)


def global_lower_bound(profile: Profile, cluster: Cluster) -> float:
    """No plan beats perfect scaling of the compute, nor the fastest possible stage of one layer."""
    gpus = cluster.gpus
    links = [lv.link for lv in cluster.levels]
    fastest = Link(
        max(k.bandwidth for k in links),
        min(k.latency for k in links),
        max(k.sync_bandwidth for k in links),
        min(k.sync_latency for k in links),
    )
    r = np.arange(1, gpus + 1, dtype=np.float64)
    single = 0.0
    for node in profile.nodes:
        if node.op == "input":
            continue
        c, p = node.compute_ms / 1000.0, float(node.param_bytes)
        single = max(single, float(np.min(stage_time(c, p, r, fastest))))
    return max(layer_compute_s(profile) / gpus, single)


def _times(
    cluster: Cluster, specs: Sequence[StageSpec], schedule: str, m: int, comm: bool,
    loads: Sequence[StageLoad], virtual: int = 1,
) -> StageTimes:  # fmt: skip
    if not comm:  # PipeDream's optimizer by default (no --activation_compression_ratio) charges none
        loads = [replace(ld, in_bytes=0.0, out_bytes=0.0) for ld in loads]
    loads = with_actions(loads, cluster.action_for(schedule), schedule, m)  # the runtime's time per action
    links = []
    for i, spec in enumerate(specs):
        near = [r for j in (i - 1, i + 1) if 0 <= j < len(specs) for r in specs[j].ranks]
        links.append(stage_link(cluster, spec.ranks, near))
    return plan_times(loads, [s.replicas for s in specs], links, schedule, m, virtual)


def held_memory(
    load: StageLoad, schedule: str, held: int, share: int, optimizer: str, recompute: bool, accumulates: bool,
    item: int = 1, between: int = 0, replicated: bool = False, later: int | None = None,
) -> int:  # fmt: skip
    """Peak bytes of one device of a stage holding ``held`` items, each ``1/share`` of a minibatch,
    accumulating gradients or not: :func:`~partitioner.optimizer.pricing.memory.peak_bytes` of the
    stage's bytes. Shared by the cost model and the simulation (which counts ``held`` itself).
    ``item``: the microbatches a minibatch runs as (:func:`backward_item`): one of them is what a
    backward works on at a time, its working bytes ``1/item`` of a minibatch's. ``between``: the
    items it holds between a split backward's B and W (:meth:`~.schedules.ScheduleModel.between`),
    each keeping its ``deferred_bytes`` share (a bound: their peak and the items' need not meet).
    ``later``: the items it holds while a backward adds to gradients already made
    (:meth:`~.schedules.ScheduleModel.later`; ``held`` if None): the step's first backward makes
    them, so the gradient being added is paid beside those items only, not beside ``held``.
    ``replicated``: a replica of a synchronous stage, which sums its gradients after the minibatch
    (:func:`~partitioner.optimizer.pricing.memory.allreduce_bytes`, when that is higher)."""
    params = load.param_bytes + load.copy_bytes
    working, added = held_working(load, item), held_added(load, schedule, accumulates)
    # (a recomputing stage's received copies are among the inputs it keeps per item already)
    per_item = load.item_bytes - (load.received_bytes if recompute else 0.0)

    def holding(items: int, transient: float) -> int:
        return round(between * load.deferred_bytes / share) + peak_bytes(
            params, per_item, items, share, schedule, optimizer, transient, load.input_bytes, recompute,
            load.master, load.kept_bytes + load.sent_bytes,
        )  # fmt: skip

    peak = holding(held, working)
    if added > 0:
        peak = max(peak, holding(held if later is None else later, working + added))
    if not replicated or model(schedule).asynchronous:
        return peak
    return max(peak, round(float(allreduce_bytes(params, optimizer, load.master))))


def held_working(load: StageLoad, item: int = 1) -> float:
    """One item's backward's working bytes and the receive posted beside it: what every backward
    of a stage holds while it runs (one item's backward at a time)."""
    return (load.working_bytes + load.posted_bytes) / item


def held_added(load: StageLoad, schedule: str, accumulates: bool) -> float:
    """The gradient a backward of a replica that accumulates makes beside the sum it adds it to
    (:func:`~partitioner.optimizer.pricing.memory.transient_bytes`; 0 where it does not)."""
    params = load.param_bytes + load.copy_bytes
    return float(transient_bytes(params, load.largest_param_bytes, schedule)) if accumulates else 0.0


def device_shares(
    memory: Sequence[int],
    transient: Sequence[float],
    ranks: Sequence[Sequence[int]],
    peaks: Mapping[int, float] | None = None,
) -> list[int]:
    """Per stage, its part of its device's peak: its own peak, except on a device that hosts several
    stages (interleaved, zbv). There, with the device's ``peaks`` walked from its list
    (:func:`laid_out_peaks`), each stage takes a share of that peak in proportion to its own; without
    one (a recomputing stage), the device holds the largest of its stages' transient bytes
    (:func:`held_backward`; one backward runs at a time) and not their sum: the other stages drop
    theirs. A device's peak is the sum of its stages' parts, as the planner checks and the runtime
    reports it."""
    out = list(memory)
    hosts = _hosts(ranks)
    for rank, stages in hosts.items():
        if len(stages) < 2:
            continue
        if peaks and rank in peaks:
            whole = sum(memory[i] for i in stages)
            for i in stages:
                out[i] = round(peaks[rank] * memory[i] / whole) if whole else 0
            continue
        keep = max(stages, key=lambda i: transient[i])
        for i in stages:
            if i != keep:
                out[i] = memory[i] - round(transient[i])
    return out


def _hosts(ranks: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    """Per rank, the stages on it (``ranks``: each stage's ranks)."""
    hosts: dict[int, list[int]] = {}
    for i, held in enumerate(ranks):
        for r in held:
            hosts.setdefault(r, []).append(i)
    return hosts


def laid_out_peaks(
    loads: Sequence[StageLoad], ranks: Sequence[Sequence[int]], schedule: str, microbatches: int,
    optimizer: str, recompute: Sequence[bool],
) -> dict[int, float]:  # fmt: skip
    """Per rank hosting several one-device stages, its peak walked from its own list of one step
    (:func:`~partitioner.optimizer.pricing.device_memory.walked_peak`); empty where no rank hosts
    several, or one of them recomputes (its items hold other bytes; :func:`device_shares` then
    bounds the device)."""
    hosts = _hosts(ranks)
    many = {r: ks for r, ks in hosts.items() if len(ks) > 1}
    if not many or any(recompute[k] for ks in many.values() for k in ks):
        return {}
    item = backward_item(False, microbatches, 1)
    lists = _lists(schedule, tuple(tuple(r) for r in ranks), microbatches)
    split = model(schedule).runtime.split_backward
    out = {}
    for r, ks in many.items():
        stages = {k: _stage_bytes(loads[k], schedule, optimizer, microbatches, item) for k in ks}
        out[r] = walked_peak(lists[r], stages, split)
    return out


@functools.lru_cache(maxsize=64)
def _lists(schedule: str, layout: Layout, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's list of one step (``runtime.schedule.build``), kept: a laid-out search assembles
    many candidates of one layout."""
    return build(schedule, layout, microbatches)


def _stage_bytes(load: StageLoad, schedule: str, optimizer: str, microbatches: int, item: int) -> StageBytes:
    """A one-device stage's bytes as :func:`held_memory` prices them, taken apart."""
    params = load.param_bytes + load.copy_bytes
    kept = params * (persistent_factor(optimizer, load.master) - 1)
    added = held_added(load, schedule, microbatches > 1)
    return StageBytes(
        kept, params, load.item_bytes / item, held_working(load, item), load.deferred_bytes / item, added
    )


def held_backward(
    load: StageLoad, schedule: str, held: int, share: int, optimizer: str, recompute: bool, accumulates: bool,
    item: int = 1, between: int = 0, later: int | None = None,
) -> float:  # fmt: skip
    """What a device of a stage holds only while one of its backwards runs, as :func:`held_memory`
    prices it: its peak over what it holds between backwards (the gradient being added, net of the
    items freed before it is, and the working bytes). :func:`device_shares` counts it once a
    device."""
    full = held_memory(
        load, schedule, held, share, optimizer, recompute, accumulates, item, between, False, later
    )  # fmt: skip
    rest = held_memory(load, schedule, held, share, optimizer, recompute, False, item, between)
    return full - rest + held_working(load, item)


def _terms(
    schedule: str, position: int, replicas: Sequence[int], microbatches: int, virtual: int
) -> tuple[int, int, int, int, bool]:
    """(held, later, between, item, accumulates) of the stage at ``position``: what
    :func:`held_memory` reads from its schedule."""
    sched = model(schedule)
    held = sched.held(position, replicas, microbatches, virtual)
    later = sched.later(position, replicas, microbatches, virtual)
    between = sched.between(position, replicas, microbatches, virtual)
    item = backward_item(sched.asynchronous, microbatches, replicas[position])
    return held, later, between, item, not sched.asynchronous and microbatches > replicas[position]


def stage_transient(
    load: StageLoad, schedule: str, position: int, replicas: Sequence[int], microbatches: int, optimizer: str,
    recompute: bool = False, virtual: int = 1,
) -> float:  # fmt: skip
    """:func:`held_backward` of the stage at ``position``, as :func:`stage_memory` charges it."""
    held, later, between, item, accumulates = _terms(schedule, position, replicas, microbatches, virtual)
    return held_backward(load, schedule, held, item, optimizer, recompute, accumulates, item, between, later)


def stage_memory(
    load: StageLoad, schedule: str, position: int, replicas: Sequence[int], microbatches: int, optimizer: str,
    recompute: bool = False, virtual: int = 1,
) -> int:  # fmt: skip
    """Peak bytes on one device of a stage: what its schedule holds in flight (``ScheduleModel``)."""
    held, later, between, item, accumulates = _terms(schedule, position, replicas, microbatches, virtual)
    return held_memory(
        load, schedule, held, item, optimizer, recompute, accumulates, item, between, replicas[position] > 1,
        later,
    )  # fmt: skip


def backward_item(whole: bool, microbatches: int, replicas: int) -> int:
    """Microbatches per minibatch as the runtime runs them: a synchronous schedule hands its
    microbatches to a stage's replicas round-robin, at least one each (``runtime.packages.job_config.
    replica_microbatches``); pipedream runs whole minibatches."""
    return 1 if whole else max(microbatches, replicas)


def price_stage(
    load: StageLoad, schedule: str, position: int, replicas: Sequence[int], microbatches: int, optimizer: str,
    recompute: bool, virtual: int = 1,
) -> StagePrice:  # fmt: skip
    """A stage's compute time and peak memory, with or without activation recomputation: the one
    place every memory check and time of a recomputing stage comes from."""
    compute = load.compute_s + (load.forward_time if recompute else 0.0)
    memory = stage_memory(load, schedule, position, replicas, microbatches, optimizer, recompute, virtual)
    return StagePrice(compute, memory)


def _priced(
    loads: Sequence[StageLoad], specs: Sequence[StageSpec], schedule: str, m: int, optimizer: str,
    recompute: str, limit: int | None, virtual: int = 1,
) -> list[tuple[bool, StagePrice]]:  # fmt: skip
    """Each stage's recompute choice and price: ``auto`` recomputes exactly the stages that do not
    fit ``limit`` without it and need less with it (each stage's memory depends on its own choice
    only; a stage whose inputs outweigh its activations gains nothing from recomputing)."""
    if recompute not in RECOMPUTE_MODES:
        raise PlanError(f"unknown recompute mode {recompute!r}; use {', '.join(RECOMPUTE_MODES)}")
    reps = [s.replicas for s in specs]
    out = []
    for i, ld in enumerate(loads):
        keep = price_stage(ld, schedule, i, reps, m, optimizer, False, virtual)
        redo = price_stage(ld, schedule, i, reps, m, optimizer, True, virtual)
        needed = limit is not None and keep.memory_bytes > limit and redo.memory_bytes < keep.memory_bytes
        again = recompute == "all" or (recompute == "auto" and needed)
        out.append((again, redo if again else keep))
    return out


def assemble(
    profile: Profile,
    cluster: Cluster,
    specs: Sequence[StageSpec],
    schedule: str,
    microbatches: int,
    optimizer: str,
    solver: SolverInfo,
    time_override: float | None = None,
    extra: dict[str, object] | None = None,
    activation_comm: bool = True,
    recompute: str = "none",
    virtual: int = 1,
) -> Plan:
    """Cost the stages and build the Plan; ``time_override`` keeps a solver's own objective value.
    ``virtual`` > 1 (``interleaved``): ``specs`` are ``gpus * virtual`` one-device stages on ranks
    ``s mod gpus``; a device's memory is its stages' sum (:func:`device_shares`).

    ``recompute`` (``none``, ``all`` or ``auto``) decides which stages recompute their forward in
    backward, priced by :func:`~partitioner.optimizer.pricing.schedules.price_stage`.

    Raises:
        InfeasibleError: a stage needs more memory than the cluster's devices have.
        PlanError: the stages use more devices than the cluster has.
    """
    used = len({r for s in specs for r in s.ranks})
    if used > cluster.gpus:
        raise PlanError(f"the plan uses {used} GPUs but the cluster has {cluster.gpus}")
    limit = cluster.memory_bytes
    loads = stage_loads(profile, [s.nodes for s in specs], cluster.cores is not None)
    priced = _priced(loads, specs, schedule, microbatches, optimizer, recompute, limit, virtual)
    loads = [replace(ld, compute_s=price.compute_s) for ld, (_, price) in zip(loads, priced, strict=True)]
    times = _times(cluster, specs, schedule, microbatches, activation_comm, loads, virtual)
    reps = [s.replicas for s in specs]
    again = [redo for redo, _ in priced]
    transient = [
        stage_transient(ld, schedule, i, reps, microbatches, optimizer, redo, virtual)
        for i, (ld, redo) in enumerate(zip(loads, again, strict=True))
    ]
    ranks = [s.ranks for s in specs]
    peaks = laid_out_peaks(loads, ranks, schedule, microbatches, optimizer, again)
    memory = device_shares([price.memory_bytes for _, price in priced], transient, ranks, peaks)
    _check_device_memory(specs, memory, limit)
    time = times.time_per_minibatch_s if time_override is None else time_override
    stages = tuple(
        Stage(i, spec.nodes, spec.replicas, spec.ranks, ld.compute_s, times.comm_s[i], memory[i], again)
        for i, (spec, ld, (again, _)) in enumerate(zip(specs, loads, priced, strict=True))
    )
    single = layer_compute_s(profile)
    everyone = Stage(0, (), cluster.gpus, tuple(range(cluster.gpus)), single)
    actions = model(schedule).actions(microbatches)
    dp = max(
        data_parallel_time(profile, cluster, schedule, microbatches),
        hosts_bound(cluster, [everyone], actions, schedule),
    )
    host = hosts_bound(cluster, stages, actions, schedule)
    pipeline, time = time, max(time, host)
    batch = profile.batch_size
    prediction = Prediction(
        time_per_minibatch_s=time,
        throughput_samples_per_s=batch / time if batch and time > 0 else None,
        bubble_fraction=times.bubble_fraction,
        speedup_vs_data_parallel=dp / time if time > 0 else None,
        speedup_vs_single=single / time if time > 0 else None,
        pipeline_s=pipeline,
        host_bound_s=host,
    )
    return Plan(
        gpus=used,
        cluster=cluster,
        schedule=schedule,
        microbatches=microbatches,
        stages=stages,
        predicted=prediction,
        solver=solver,
        batch_size=profile.batch_size,
        optimizer=optimizer,
        model=profile.model,
        extra={**(extra or {}), "activation_comm": activation_comm, "recompute": recompute},
        virtual_stages=virtual,
    )


def _check_device_memory(specs: Sequence[StageSpec], memory: Sequence[int], limit: int | None) -> None:
    """Every device holds its stages (several, where a schedule lays them so) within ``limit``."""
    if limit is None:
        return
    per_rank = {r: [memory[i] for i in ks] for r, ks in _hosts([s.ranks for s in specs]).items()}
    if all(len(held) == 1 for held in per_rank.values()):
        if max(memory) > limit:
            worst = max(range(len(memory)), key=memory.__getitem__)
            raise InfeasibleError(
                f"stage {worst} needs {gib(memory[worst])} per GPU but only {gib(limit)} is available; "
                f"raise --memory to at least {gib(max(memory))} or use more GPUs"
            )
        return
    worst = max(per_rank, key=lambda r: sum(per_rank[r]))
    if sum(per_rank[worst]) > limit:
        raise InfeasibleError(
            f"GPU {worst} needs {gib(sum(per_rank[worst]))} for its stages but only {gib(limit)} is "
            f"available; raise --memory to at least {gib(sum(per_rank[worst]))}, use fewer --virtual-stages "
            "or more GPUs"
        )
