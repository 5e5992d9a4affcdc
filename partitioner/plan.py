"""What the optimizer decides: ``Plan`` / ``Stage`` / ``Cluster``, plan.json and PipeDream's mp_conf.json.

Plain data with no torch import, so plans are made, stored and compared anywhere. The runtime reads
the JSON these functions write, never this module.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from partitioner.errors import PlanError
from runtime.files.atomic import write_text_atomic
from runtime.files.formats import PLAN_FIELDS
from runtime.files.schema import SchemaError, check

__all__ = [
    "OPTIMIZERS",
    "PLAN_SCHEMA",
    "SHARD_LEVELS",
    "Cluster",
    "Level",
    "Link",
    "Plan",
    "Prediction",
    "SolverInfo",
    "Stage",
    "Tie",
    "load_plan",
    "mp_conf",
    "plan_from_json",
    "plan_to_json",
    "save_plan",
]

PLAN_SCHEMA = "pipeplan.plan/1"
OPTIMIZERS: tuple[str, ...] = ("sgd", "momentum", "adam", "adamw")
SHARD_LEVELS: tuple[str, ...] = ("none", "optimizer", "gradients", "full")
"""What a stage's data-parallel copies share (docs/layout-3d.md): nothing, the optimizer state
(ZeRO-1), gradients too (ZeRO-2), or everything (FSDP, ZeRO-3)."""


@dataclass(frozen=True)
class Link:
    """What a message between two units costs: ``latency + bytes / bandwidth`` (the alpha-beta model).

    The cost model prices every message with one of these (``pricing/stage.py``), so a schedule that
    sends more messages (more microbatches, virtual stages) pays for each of them.

    A gradient all-reduce is priced as a ring of such steps (``allreduce_time``) with its own alpha
    and beta where they were measured apart: gloo's collectives on CPU ranks cost more per byte and
    per step than its point-to-point messages (``pipeplan probe`` fits them; None: a message's).

    Attributes:
        bandwidth: bytes per second, one direction.
        latency: seconds every message costs besides its bytes (0: bandwidth only).
        allreduce_bandwidth: the all-reduce's bandwidth in the same formula (None: ``bandwidth``).
        allreduce_latency: the all-reduce's latency per ring step (None: ``latency``).
    """

    bandwidth: float
    latency: float = 0.0
    allreduce_bandwidth: float | None = None
    allreduce_latency: float | None = None

    @property
    def sync_bandwidth(self) -> float:
        """The bandwidth a gradient all-reduce is priced with."""
        return self.bandwidth if self.allreduce_bandwidth is None else self.allreduce_bandwidth

    @property
    def sync_latency(self) -> float:
        """The latency a gradient all-reduce pays per ring step."""
        return self.latency if self.allreduce_latency is None else self.allreduce_latency


@dataclass(frozen=True)
class Level:
    """One level of the device hierarchy.

    Attributes:
        devices: units of the level below in one unit of this level (GPUs per server, servers per rack).
        bandwidth: bytes per second between those units.
        latency: seconds one message between those units costs besides its bytes.
        allreduce_bandwidth, allreduce_latency: a gradient all-reduce's own figures (:class:`Link`).
    """

    devices: int
    bandwidth: float
    latency: float = 0.0
    allreduce_bandwidth: float | None = None
    allreduce_latency: float | None = None

    @property
    def link(self) -> Link:
        """The link between this level's units."""
        return Link(self.bandwidth, self.latency, self.allreduce_bandwidth, self.allreduce_latency)


@dataclass(frozen=True)
class Cluster:
    """The devices a plan runs on, innermost level first (``4,4`` = 4 servers of 4 GPUs).

    Attributes:
        levels: the hierarchy; a flat cluster has one level.
        memory_bytes: memory of one device; None means unlimited.
        cores: where the devices are CPU processes, the cores of one host (one unit of the innermost
            level), which its processes time-slice; None: every device computes on its own (GPUs).
        threads: compute threads of one CPU process (the profile's), with ``cores``.
        action_s: seconds the runtime spends on each compute action of a device (a forward, a
            backward, a split backward's B or W) besides its layers' time: the Python between two
            actions, setting up autograd, posting the action's messages. Measured from a traced run
            by ``pipeplan calibrate --trace`` (the mean idle gap after a compute span); 0: not priced.
        schedule_action_s: (schedule, seconds) where a schedule's ranks spend another time per action
            than ``action_s`` (a rank hosting two stages, interleaved and zbv: ``pipeplan probe``
            times each); :meth:`action_for` reads it.
    """

    levels: tuple[Level, ...]
    memory_bytes: int | None = None
    cores: int | None = None
    threads: int = 1
    action_s: float = 0.0
    schedule_action_s: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.levels:
            raise PlanError("a cluster needs at least one level")
        for level in self.levels:
            if level.devices < 1:
                raise PlanError(f"every level needs at least 1 device, got {level.devices}")
            if not level.bandwidth > 0:
                raise PlanError(f"bandwidth must be > 0 bytes/s, got {level.bandwidth}")
            if not level.latency >= 0:
                raise PlanError(f"latency must be >= 0 s, got {level.latency}")
            if level.allreduce_bandwidth is not None and not level.allreduce_bandwidth > 0:
                raise PlanError(f"all-reduce bandwidth must be > 0 bytes/s, got {level.allreduce_bandwidth}")
            if level.allreduce_latency is not None and not level.allreduce_latency >= 0:
                raise PlanError(f"all-reduce latency must be >= 0 s, got {level.allreduce_latency}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise PlanError(f"memory must be > 0 bytes, got {self.memory_bytes}")
        if self.cores is not None and self.cores < 1:
            raise PlanError(f"a host needs at least 1 core, got {self.cores}")
        if self.threads < 1:
            raise PlanError(f"a CPU process needs at least 1 thread, got {self.threads}")
        if not self.action_s >= 0 or not all(s >= 0 for _, s in self.schedule_action_s):
            got = [self.action_s, *(s for _, s in self.schedule_action_s)]
            raise PlanError(f"the time per action must be >= 0 s, got {min(got)}")

    def action_for(self, schedule: str) -> float:
        """The runtime's time per action under ``schedule``: its own measured figure, else ``action_s``."""
        return dict(self.schedule_action_s).get(schedule, self.action_s)

    @property
    def gpus(self) -> int:
        """Total devices."""
        return math.prod(level.devices for level in self.levels)

    @property
    def slowest(self) -> Link:
        """The slowest link of any level (least bandwidth, most latency): what a search that sees
        one level prices every message with (and every all-reduce: the slowest level's figures)."""
        links = [lv.link for lv in self.levels]
        return Link(
            min(k.bandwidth for k in links),
            max(k.latency for k in links),
            min(k.sync_bandwidth for k in links),
            max(k.sync_latency for k in links),
        )

    @staticmethod
    def flat(gpus: int, bandwidth: Link | float = 1e9, memory_bytes: int | None = None) -> Cluster:
        """One level of ``gpus`` devices joined by a link (a bare number: its bandwidth, no latency)."""
        link = bandwidth if isinstance(bandwidth, Link) else Link(bandwidth)
        level = Level(gpus, link.bandwidth, link.latency, link.allreduce_bandwidth, link.allreduce_latency)
        return Cluster((level,), memory_bytes)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a set of layers and the devices that run it, ``tensor_parallel`` devices
    to a copy and ``replicas`` data-parallel copies (docs/layout-3d.md).

    Attributes:
        index: position in the pipeline, from 0.
        nodes: ids of the profile nodes it runs, in topological order.
        replicas: data-parallel width ``d``: copies of the stage, each running its own microbatches.
        ranks: global ranks of its ``d * t`` devices, data-major (``ranks[i * t + j]``: tensor rank
            ``j`` of copy ``i``; a copy's ranks are consecutive, inside one node).
        compute_s: forward+backward seconds per minibatch on one device (before dividing by replicas).
        comm_s: predicted communication seconds per minibatch (activations and gradient all-reduce).
        memory_bytes: predicted peak memory per device.
        recompute: whether the stage recomputes its forward in backward (activation checkpointing),
            keeping only its inputs per microbatch in flight; absent in older plan.json: False.
        bubble_fraction: the share of its device's time the plan's simulation has it not computing
            (``pricing.simulate.stage_bubbles``), which ``run`` measures against; None: not
            predicted (plans written before it, or not yet simulated).
        tensor_parallel: ``t``, the devices one copy is split over (1: not split; absent in plans
            written before 3D layouts).
        shard: what the copies share, one of :data:`SHARD_LEVELS` (``none``: each holds everything).
    """

    index: int
    nodes: tuple[str, ...]
    replicas: int
    ranks: tuple[int, ...]
    compute_s: float = 0.0
    comm_s: float = 0.0
    memory_bytes: int = 0
    recompute: bool = False
    bubble_fraction: float | None = None
    tensor_parallel: int = 1
    shard: str = "none"

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise PlanError(f"stage {self.index}: tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.shard not in SHARD_LEVELS:
            raise PlanError(
                f"stage {self.index}: shard must be one of {', '.join(SHARD_LEVELS)}, got {self.shard!r}"
            )
        if self.shard != "none" and self.replicas < 2:
            raise PlanError(f"stage {self.index}: shard {self.shard!r} needs at least 2 data-parallel copies")
        if self.tensor_parallel > 1 and len(self.ranks) != self.devices:  # (2D plans: as before)
            raise PlanError(
                f"stage {self.index}: {len(self.ranks)} ranks for {self.replicas} copies of "
                f"{self.tensor_parallel} devices"
            )

    @property
    def devices(self) -> int:
        """Devices the stage runs on: ``replicas * tensor_parallel``."""
        return self.replicas * self.tensor_parallel


@dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for the plan.

    ``time_per_minibatch_s`` is the slower of the pipeline's own time (``pipeline_s``) and
    ``host_bound_s``, the time the busiest host needs to run its CPU processes' compute on its cores
    (0 for GPUs): on 2 cores, 4 CPU ranks cannot all compute at once however the stages balance.
    """

    time_per_minibatch_s: float
    throughput_samples_per_s: float | None = None
    bubble_fraction: float = 0.0
    speedup_vs_data_parallel: float | None = None
    speedup_vs_single: float | None = None
    pipeline_s: float | None = None
    host_bound_s: float = 0.0


@dataclass(frozen=True)
class SolverInfo:
    """How the plan was found, and how far from optimal it can be."""

    name: str
    solve_time_s: float
    optimal: bool
    lower_bound_s: float | None = None


@dataclass(frozen=True)
class Tie:
    """A parameter shared by several stages (tied weights); the runtime keeps the copies equal.

    Attributes:
        name: the parameter's canonical name in the original model.
        members: (stage index, parameter name inside that stage's module) for every holder.
    """

    name: str
    members: tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class Plan:
    """A complete partitioning decision plus its prediction.

    Attributes:
        gpus: devices used, the sum of the stages' devices (``Stage.devices``).
        cluster: the cluster it was planned for.
        schedule: the pipeline schedule the cost model assumed.
        microbatches: microbatches per minibatch (1 for ``pipedream``).
        stages: the stages in pipeline order.
        predicted: the cost model's prediction.
        solver: how it was found.
        batch_size: samples per minibatch; None when the profile does not say.
        optimizer: the training optimizer the memory model assumed.
        model: the model spec the profile came from.
        profile: path of the profile it was planned from.
        ties: shared parameters split across stages.
        extra: anything else worth keeping (inputs, loss convention, ...).
        precision: ``fp32``, ``bf16`` or ``fp16``: what the profile was measured in and ``pipeplan
            run`` trains in by default (autocast; float32 weights either way).
        virtual_stages: stages per device: 1, or ``v`` under ``interleaved`` (Megatron's virtual
            stages: ``gpus * v`` stages, stage ``s`` on rank ``s mod gpus``), 2 under ``zbv``
            (``2 gpus`` stages as a V: stages ``r`` and ``2 gpus - 1 - r`` on rank ``r``).
    """

    gpus: int
    cluster: Cluster
    schedule: str
    microbatches: int
    stages: tuple[Stage, ...]
    predicted: Prediction
    solver: SolverInfo
    batch_size: int | None = None
    optimizer: str = "sgd"
    model: str = ""
    profile: str = ""
    ties: tuple[Tie, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    precision: str = "fp32"
    virtual_stages: int = 1

    @property
    def gap(self) -> float | None:
        """Relative distance of the pipeline's predicted time above the solver's lower bound, if known
        (not for a plan priced by simulation: the bound is the search's closed form's)."""
        bound = self.solver.lower_bound_s
        if not bound or self.extra.get("priced_by") == "simulation":
            return None
        time = self.predicted.pipeline_s or self.predicted.time_per_minibatch_s
        return max(0.0, time / bound - 1.0)  # (rounding: never below 0)

    def stage_of(self) -> dict[str, int]:
        """Map from node id to the index of the stage that runs it."""
        return {node: stage.index for stage in self.stages for node in stage.nodes}


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The plan.json document (schema ``pipeplan.plan/1``)."""
    doc: dict[str, Any] = {"schema": PLAN_SCHEMA}
    doc.update(asdict(plan))
    doc["extra"] = dict(plan.extra)
    if plan.virtual_stages == 1:  # only interleaved plans say it (older readers never see the field)
        del doc["virtual_stages"]
    for level in doc["cluster"]["levels"]:  # only links with a latency say it (as above)
        if not level["latency"]:
            del level["latency"]
        for key in ("allreduce_bandwidth", "allreduce_latency"):  # only measured ones (as above)
            if level[key] is None:
                del level[key]
    if not plan.cluster.action_s:  # only calibrated clusters say it (as above)
        del doc["cluster"]["action_s"]
    if plan.cluster.schedule_action_s:  # only probed ones (as above)
        doc["cluster"]["schedule_action_s"] = dict(plan.cluster.schedule_action_s)
    else:
        del doc["cluster"]["schedule_action_s"]
    for stage in doc["stages"]:  # only simulated plans say it; only 3D stages their layout (as above)
        if stage["bubble_fraction"] is None:
            del stage["bubble_fraction"]
        if stage["tensor_parallel"] == 1:
            del stage["tensor_parallel"]
        if stage["shard"] == "none":
            del stage["shard"]
    return doc


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


def plan_from_json(doc: Mapping[str, Any], source: str = "plan") -> Plan:
    """Parse a plan.json document; PlanError says what is wrong with it."""
    if not isinstance(doc, Mapping) or doc.get("schema") != PLAN_SCHEMA:
        raise PlanError(f"{source} is not a pipeplan plan (expected schema {PLAN_SCHEMA!r})")
    try:
        check(doc, PLAN_FIELDS, source)
    except SchemaError as exc:
        raise PlanError(f"{exc}; regenerate it with `pipeplan partition`") from None
    try:
        cluster = doc["cluster"]
        return Plan(
            gpus=int(doc["gpus"]),
            cluster=Cluster(
                tuple(
                    Level(
                        int(lv["devices"]),
                        float(lv["bandwidth"]),
                        float(lv.get("latency", 0.0)),
                        _optional(lv.get("allreduce_bandwidth")),
                        _optional(lv.get("allreduce_latency")),
                    )
                    for lv in cluster["levels"]
                ),
                cluster.get("memory_bytes"),
                cluster.get("cores"),
                int(cluster.get("threads", 1)),
                float(cluster.get("action_s", 0.0)),
                tuple((str(k), float(v)) for k, v in dict(cluster.get("schedule_action_s", {})).items()),
            ),
            schedule=str(doc["schedule"]),
            microbatches=int(doc["microbatches"]),
            stages=tuple(_stage_from_json(s) for s in doc["stages"]),
            predicted=Prediction(**doc["predicted"]),
            solver=SolverInfo(**doc["solver"]),
            batch_size=doc.get("batch_size"),
            optimizer=str(doc.get("optimizer", "sgd")),
            precision=str(doc.get("precision") or "fp32"),  # plans from before precision: fp32
            model=str(doc.get("model", "")),
            profile=str(doc.get("profile", "")),
            ties=tuple(
                Tie(str(t["name"]), tuple((int(s), str(p)) for s, p in t["members"]))
                for t in doc.get("ties", ())
            ),
            extra=dict(doc.get("extra", {})),
            virtual_stages=int(doc.get("virtual_stages") or 1),  # plans from before interleaved: 1
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"{source} is corrupt: bad or missing field {exc}") from exc


def _stage_from_json(doc: Mapping[str, Any]) -> Stage:
    return Stage(
        index=int(doc["index"]),
        nodes=tuple(str(n) for n in doc["nodes"]),
        replicas=int(doc["replicas"]),
        ranks=tuple(int(r) for r in doc["ranks"]),
        compute_s=float(doc.get("compute_s", 0.0)),
        comm_s=float(doc.get("comm_s", 0.0)),
        memory_bytes=int(doc.get("memory_bytes", 0)),
        recompute=_flag(doc.get("recompute", False), "recompute"),
        bubble_fraction=None if doc.get("bubble_fraction") is None else float(doc["bubble_fraction"]),
        tensor_parallel=int(doc.get("tensor_parallel", 1)),
        shard=str(doc.get("shard", "none")),
    )


def _flag(value: Any, name: str) -> bool:
    """A JSON boolean, refused otherwise (a string "false" must not read as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {value!r}")
    return value


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write plan.json atomically."""
    return write_text_atomic(path, json.dumps(plan_to_json(plan), indent=1) + "\n")


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan.json written by :func:`save_plan`."""
    source = Path(path)
    try:
        doc = json.loads(source.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PlanError(f"cannot read plan {source}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise PlanError(f"{source} is not valid JSON: {exc}") from exc
    return plan_from_json(doc, str(source))


def mp_conf(stages: Sequence[Stage]) -> dict[str, Any]:
    """PipeDream's mp_conf.json: one module per stage, then the criterion on the last stage."""
    if not stages:
        raise PlanError("a plan needs at least one stage")
    modules = [stage.index for stage in stages] + [stages[-1].index]
    return {
        "module_to_stage_map": modules,
        "stage_to_rank_map": {str(stage.index): list(stage.ranks) for stage in stages},
    }
