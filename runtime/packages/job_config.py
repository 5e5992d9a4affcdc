"""What one rank needs to know about its job, read from a package's mp_conf.json and plan.json.

The runtime reads the JSON files directly (never ``partitioner.plan``) so a cluster node needs only
torch and this package. Everything is parsed once into frozen dataclasses; every rank derives the
same :class:`JobConfig` and picks its own :class:`RankConfig` from it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import RunError
from runtime.files.find_newest import package_folder
from runtime.files.formats import MP_CONF_FIELDS, PLAN_FIELDS
from runtime.files.read_json import read_json
from runtime.files.schema import Obj, SchemaError, check
from runtime.packages.layout3d import StageLayout, copy_layout, stage_layouts
from runtime.precision import check_precision
from runtime.schedule import REGISTRY, Layout, ScheduleError, get_schedule

__all__ = ["JobConfig", "RankConfig", "StagePrediction", "load_job", "replica_microbatches"]


@dataclass(frozen=True)
class StagePrediction:
    """One plan.json stage's predictions; None: not predicted.

    Attributes:
        compute_s: forward, backward and update seconds per minibatch on one device, replicas
            summed (plan.json's ``compute_s``), and tensor ranks too: each of a 3D stage's ``t``
            tensor ranks computes its share for the whole time, and the run sums every rank.
        comm_s: seconds per minibatch one replica's messages take on the wire: its output's cut
            out and back and its gradient all-reduce (plan.json's ``comm_s``).
        bubble: the share of its device's time the plan's simulation has it not computing
            (plan.json's ``bubble_fraction``; plans written before it have none).
    """

    compute_s: float | None = None
    comm_s: float | None = None
    bubble: float | None = None

    @staticmethod
    def of(stage: Mapping[str, Any]) -> StagePrediction:
        """From a plan.json stage. A plan with no compute time (written by hand: 0) predicts no time
        for the stage at all, its communication's 0 included."""
        compute = float(stage.get("compute_s") or 0.0) * int(stage.get("tensor_parallel") or 1)
        bubble = stage.get("bubble_fraction")
        return StagePrediction(
            compute or None,
            float(stage.get("comm_s") or 0.0) if compute else None,
            float(bubble) if bubble is not None else None,
        )


@dataclass(frozen=True)
class JobConfig:
    """The whole job, identical on every rank.

    Attributes:
        package: folder of the generated package.
        stage_ranks: global ranks of every stage's replicas, in pipeline order.
        schedule: ``pipedream``, ``1f1b``, ``gpipe``, ``zb1p``, ``interleaved`` or ``zbv`` (whose
            packages put several stages on a rank: :attr:`virtual_stages`).
        microbatches: microbatches per minibatch.
        batch_size: samples per minibatch.
        ties: for each tied parameter, its (stage, parameter name in the stage module) holders.
        predicted_time_s: plan.json's predicted seconds per minibatch (None when unknown).
        inputs: plan.json's ``extra.inputs`` (name, shape, dtype of the first stage's inputs).
        module_stages: mp_conf.json's ``module_to_stage_map``: the stage of each entry of the
            package's ``model(criterion)``, the criterion last (``[0, 0, 1, 1, 1]`` in PipeDream's
            own packages: two modules on stage 0, two and the criterion on stage 1).
        model: plan.json's model spec (recorded in metrics.json, so calibration can match the two).
        targets: plan.json's ``extra.targets`` (kind ``classes`` with ``high`` classes, ``next_token``
            or ``normal``); None when not recorded.
        recompute: per stage, whether it recomputes its forward in backward (plan.json's stages'
            ``recompute``; absent: none).
        predicted_memory_bytes: per stage, plan.json's predicted peak bytes per device (absent: ()).
        predicted_stages: per stage, plan.json's predicted compute seconds (one device, replicas
            summed), communication seconds (one replica) per minibatch and bubble share, each None
            where the plan does not predict it (:mod:`runtime.observing.fidelity` measures against them).
        precision: fp32, bf16 or fp16: what the stages compute in (:mod:`runtime.precision`).
        plan_precision: the precision plan.json was planned for (its profile's; fp32 when it does
            not say).
        layouts: per stage, its tensor-parallel degree, copies and shard level
            (:mod:`runtime.packages.layout3d`); empty: every stage plain replicas.
    """

    package: Path
    stage_ranks: tuple[tuple[int, ...], ...]
    schedule: str
    microbatches: int
    batch_size: int
    ties: tuple[tuple[tuple[int, str], ...], ...] = ()
    predicted_time_s: float | None = None
    inputs: tuple[dict[str, Any], ...] = ()
    module_stages: tuple[int, ...] = ()
    model: str = ""
    targets: dict[str, Any] | None = None
    recompute: tuple[bool, ...] = ()
    predicted_memory_bytes: tuple[int, ...] = ()
    predicted_stages: tuple[StagePrediction, ...] = ()
    precision: str = "fp32"
    plan_precision: str = "fp32"
    layouts: tuple[StageLayout, ...] = ()

    def layout(self, stage: int) -> StageLayout:
        """Stage ``stage``'s layout (plain replicas where the plan gives none)."""
        if self.layouts:
            return self.layouts[stage]
        return StageLayout(1, len(self.stage_ranks[stage]))

    @property
    def is_3d(self) -> bool:
        """Whether some stage is split over tensor ranks or shards its copies."""
        return any(lay.is_3d for lay in self.layouts)

    @property
    def copy_layout(self) -> tuple[tuple[int, ...], ...]:
        """The layout the schedule plays: one virtual rank per copy (the plan's own layout when no
        stage is split over tensor ranks)."""
        return copy_layout(self.stage_ranks, [self.layout(k) for k in range(self.stages)])

    def copy_rank(self, rank: int) -> int:
        """The virtual rank of ``rank``'s copy in :attr:`copy_layout`."""
        k = next(k for k, ranks in enumerate(self.stage_ranks) if rank in ranks)
        t = self.layout(k).tensor_parallel
        return self.copy_layout[k][self.stage_ranks[k].index(rank) // t]

    @property
    def world_size(self) -> int:
        """Ranks the package runs on."""
        return len({r for ranks in self.stage_ranks for r in ranks})

    @property
    def virtual_stages(self) -> int:
        """Stages per rank: 1, or ``v`` when the package lays ``p * v`` stages on ``p`` ranks for
        ``interleaved`` (stage ``s`` on rank ``s mod p``) or, ``v = 2``, for ``zbv`` (a V), each
        copy of the stages on ``p`` ranks of its own."""
        hosted = Counter(r for ranks in self.copy_layout for r in ranks)
        return max(1, max(hosted.values(), default=1))

    @property
    def stages(self) -> int:
        """Pipeline depth."""
        return len(self.stage_ranks)

    def hosted_stages(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs, in pipeline order."""
        return tuple(k for k, ranks in enumerate(self.stage_ranks) if rank in ranks)

    def for_rank(self, rank: int) -> RankConfig:
        """The view of one rank: its stage and its place among the stage's replicas."""
        for stage, ranks in enumerate(self.stage_ranks):
            if rank in ranks:
                return self._config(rank, stage)
        raise RunError(f"rank {rank} runs no stage of {self.package}; its ranks are 0..{self.world_size - 1}")

    def hosted(self, rank: int) -> tuple[RankConfig, ...]:
        """Every stage ``rank`` runs, in pipeline order: one, or its chunks under ``interleaved``."""
        found = tuple(
            self._config(rank, stage) for stage, ranks in enumerate(self.stage_ranks) if rank in ranks
        )
        return found or (self.for_rank(rank),)

    def _config(self, rank: int, stage: int) -> RankConfig:
        copy, tensor_rank = divmod(self.stage_ranks[stage].index(rank), self.layout(stage).tensor_parallel)
        return RankConfig(self, rank, stage, copy, tensor_rank)


@dataclass(frozen=True)
class RankConfig:
    """One rank's role.

    Attributes:
        job: the job it belongs to.
        rank: global rank.
        stage: the stage it runs.
        replica: its index among the stage's replicas, or copies of a tensor-parallel stage (its
            work: ``Schedule.replica_of``).
        tensor_rank: its place inside its copy (0 when the stage is not split over tensor ranks).
    """

    job: JobConfig
    rank: int
    stage: int
    replica: int
    tensor_rank: int = 0

    @property
    def layout(self) -> StageLayout:
        return self.job.layout(self.stage)

    @property
    def replica_ranks(self) -> tuple[int, ...]:
        """Ranks of this stage's replicas holding what this rank holds (its data-parallel group: the
        copies' ranks of its tensor rank)."""
        return self.job.stage_ranks[self.stage][self.tensor_rank :: self.layout.tensor_parallel]

    @property
    def leads(self) -> bool:
        """The stage's first rank (copy 0, tensor rank 0), which speaks for it at start-up."""
        return self.replica == 0 and self.tensor_rank == 0

    @property
    def recompute(self) -> bool:
        """Whether this rank's stage recomputes its forward in backward."""
        return bool(self.job.recompute) and self.job.recompute[self.stage]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.job.stages - 1


def _checked_json(path: Path, fields: Obj) -> Any:
    """A package file, read and checked against its schema (:mod:`runtime.files.formats`)."""
    missing = f"{path} is missing; is {path.parent} a package written by `pipeplan partition`?"
    doc = read_json(path, missing=missing)
    try:
        check(doc, fields, str(path))
    except SchemaError as exc:
        raise RunError(f"{exc}; regenerate the package with `pipeplan partition`") from None
    return doc


def _stage_ranks(conf: Any, source: Path) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """(ranks of every stage, stage of every module) from PipeDream's mp_conf, checked."""
    try:
        mapping = {int(k): tuple(int(r) for r in v) for k, v in conf["stage_to_rank_map"].items()}
        modules = tuple(int(s) for s in conf["module_to_stage_map"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RunError(f"{source} is not PipeDream's mp_conf format: {exc}") from exc
    if sorted(mapping) != list(range(len(mapping))) or not mapping:
        raise RunError(f"{source}: stages must be numbered 0..N-1, got {sorted(mapping)}")
    last = len(mapping) - 1
    in_order = list(modules[:-1]) == sorted(modules[:-1]) and set(modules[:-1]) == set(mapping)
    if len(modules) < 2 or not in_order or modules[-1] != last:
        raise RunError(
            f"{source}: module_to_stage_map must give every stage's modules in stage order, plus the "
            f"criterion on the last stage (e.g. [0, 1, 1] or [0, 0, 1, 1, 1]), got {list(modules)}"
        )
    ranks = sorted(r for rs in mapping.values() for r in rs)
    layout = tuple(mapping[k] for k in range(len(mapping)))
    laid_out = _laid_out_by(layout) or _copies_shared(layout)
    if (ranks != list(range(len(ranks))) and not laid_out) or any(not rs for rs in layout):
        raise RunError(
            f"{source}: ranks must be 0..N-1 each used once (or, for interleaved, stage s on rank s mod N "
            f"alone; for zbv, stages s and 2N-1-s on rank s), got {ranks}"
        )
    return tuple(mapping[k] for k in range(len(mapping))), modules


def _copies_shared(layout: Layout) -> bool:
    """Several-rank stages that share ranks only whole (a 3D plan's interleaved or zbv layout, whose
    copy layout :func:`_check_layout` then checks), every rank 0..N-1 used."""
    used = sorted({r for rs in layout for r in rs})
    whole = all(a == b or not set(a) & set(b) for a in layout for b in layout)
    return any(len(rs) > 1 for rs in layout) and whole and used == list(range(len(used)))


def _laid_out_by(layout: Layout) -> list[str]:
    """The schedules that lay several stages on each rank exactly as ``layout`` does."""
    p = len({r for rs in layout for r in rs})
    v = len(layout) // p
    return [name for name, kind in REGISTRY.items() if kind.placement and kind.placement(p, v) == layout]


def load_job(
    package: str | Path,
    schedule: str | None = None,
    microbatches: int | None = None,
    batch_size: int | None = None,
    precision: str | None = None,
) -> JobConfig:
    """Read a package's mp_conf.json and plan.json; explicit arguments override the plan.

    Raises:
        RunError: a missing package, a malformed file or impossible settings, in one line.
    """
    folder = package_folder(package)
    conf = _checked_json(folder / "mp_conf.json", MP_CONF_FIELDS)
    ranks, modules = _stage_ranks(conf, folder / "mp_conf.json")
    plan = _checked_json(folder / "plan.json", PLAN_FIELDS) if (folder / "plan.json").exists() else {}
    _check_plan_matches(plan, ranks, folder)
    layouts = stage_layouts(plan, ranks, f"{folder}/plan.json")
    inputs = tuple(plan.get("extra", {}).get("inputs", ()))
    default_batch = plan.get("batch_size") or (inputs[0]["shape"][0] if inputs else None)
    predicted = plan.get("predicted", {}).get("time_per_minibatch_s")
    batch = int(batch_size or default_batch or 0)
    name = str(schedule or plan.get("schedule") or "1f1b")
    planned = str(plan.get("precision") or "fp32")  # plans written before precision existed: fp32
    job = JobConfig(
        package=folder.resolve(),
        stage_ranks=ranks,
        schedule=name,
        microbatches=microbatches
        or replica_microbatches(int(plan.get("microbatches") or 1), _copies(ranks, layouts), batch, name),
        batch_size=batch,
        ties=tuple(tuple((int(s), str(p)) for s, p in t["members"]) for t in plan.get("ties", ())),
        predicted_time_s=float(predicted) if predicted else None,
        inputs=inputs,
        module_stages=modules,
        model=str(plan.get("model") or ""),
        targets=plan.get("extra", {}).get("targets"),
        recompute=_per_stage(plan, "recompute", folder),
        predicted_memory_bytes=tuple(int(s.get("memory_bytes") or 0) for s in plan.get("stages") or ()),
        predicted_stages=tuple(StagePrediction.of(s) for s in plan.get("stages") or ()),
        precision=precision or planned,
        plan_precision=planned,
        layouts=layouts if any(lay.is_3d for lay in layouts) else (),
    )
    _check_schedule_fits(_checked(job), str(plan.get("schedule") or name))
    return job


def _copies(
    ranks: tuple[tuple[int, ...], ...], layouts: tuple[StageLayout, ...]
) -> tuple[tuple[int, ...], ...]:
    """Each stage's copies (one entry per copy): what splits a minibatch's microbatches."""
    return tuple(rs[:: lay.tensor_parallel] for rs, lay in zip(ranks, layouts, strict=True))


def _check_schedule_fits(job: JobConfig, planned: str) -> None:
    """A schedule that lays several stages on each rank (interleaved), on a package with one stage per
    rank, would play plain 1f1b: refuse it unless the plan itself lays stages out (then it was asked
    for)."""
    kind, plan_kind = REGISTRY.get(job.schedule), REGISTRY.get(planned)
    lays_out = kind is not None and kind.placement is not None  # several stages on each rank
    if lays_out and job.virtual_stages == 1 and (plan_kind is None or plan_kind.placement is None):
        raise RunError(
            f"{job.package} was planned for {planned} with one stage per rank, which --schedule "
            "interleaved would play as 1f1b; partition with --schedule interleaved (several stages per "
            f"rank), or run it with --schedule {planned}"
        )


def _per_stage(plan: Any, key: str, folder: Path) -> tuple[bool, ...]:
    """A boolean per stage from plan.json (False where a stage, or the whole plan, lacks it)."""
    flags = tuple(s.get(key, False) for s in plan.get("stages") or ())
    if not all(isinstance(f, bool) for f in flags):
        raise RunError(f"{folder}/plan.json: every stage's {key!r} must be true or false, got {list(flags)}")
    return flags


def _check_plan_matches(plan: Any, ranks: tuple[tuple[int, ...], ...], folder: Path) -> None:
    """plan.json and mp_conf.json describe the same stages on the same ranks (an edited or mixed-up
    package would otherwise train a layout nobody planned)."""
    if not isinstance(plan, dict):
        raise RunError(
            f"{folder}/plan.json is not a JSON object; regenerate the package with `pipeplan partition`"
        )
    stages = plan.get("stages")
    if stages is None:
        return
    try:
        planned = tuple(tuple(int(r) for r in s["ranks"]) for s in stages)
    except (KeyError, TypeError, ValueError) as exc:
        raise RunError(f"{folder}/plan.json has a stage without a valid ranks list: {exc}") from exc
    if planned != ranks:
        raise RunError(
            f"{folder}: plan.json puts stages on ranks {[list(r) for r in planned]} but mp_conf.json on "
            f"{[list(r) for r in ranks]}; regenerate the package with `pipeplan partition`"
        )


def replica_microbatches(
    planned: int, stage_ranks: tuple[tuple[int, ...], ...], batch_size: int, schedule: str = "1f1b"
) -> int:
    """Microbatches per minibatch so that every replica of every stage gets work.

    pipedream hands whole minibatches to replicas, so it keeps the plan's count. The synchronous
    schedules hand a minibatch's microbatches to the replicas round-robin, so a plan with fewer
    microbatches than some stage has replicas runs with ``lcm(planned, replicas...)`` microbatches
    instead (the gradient is still the minibatch mean), if that divides the batch.
    """
    widest = max(len(r) for r in stage_ranks)
    if planned >= widest or not get_schedule(schedule).flushes:
        return planned
    for candidate in (math.lcm(planned, *(len(r) for r in stage_ranks)), widest):
        if batch_size % candidate == 0:
            return candidate
    return planned


def _checked(job: JobConfig) -> JobConfig:
    try:
        kind = get_schedule(job.schedule)
    except ScheduleError as exc:
        raise RunError(str(exc)) from exc
    if job.batch_size < 1:
        raise RunError(f"{job.package}: plan.json gives no batch size; pass --batch-size")
    if job.microbatches < 1 or job.microbatches > job.batch_size:
        raise RunError(f"--microbatches must be between 1 and the batch size {job.batch_size}")
    if job.batch_size % job.microbatches:
        raise RunError(
            f"batch size {job.batch_size} does not split into {job.microbatches} equal microbatches; "
            "pick --microbatches that divides --batch-size"
        )
    check_precision(job.precision, job.schedule)
    _check_layout(job)
    _check_3d(job)
    for tie in job.ties:
        if any(not 0 <= s < job.stages for s, _ in tie):
            raise RunError(f"{job.package}/plan.json: tie {tie} names a stage that does not exist")
        widths = {len(job.stage_ranks[s]) for s, _ in tie}
        if kind.stashes and len(widths) > 1:
            raise RunError(
                f"tied weights on stages {sorted({s for s, _ in tie})} with {sorted(widths)} replicas would "
                "step at different rates under pipedream; use --schedule 1f1b, or partition with --straight"
            )
    return job


def _check_layout(job: JobConfig) -> None:
    """A schedule that lays several stages on each rank (``interleaved``, ``zbv``) runs a package laid
    out as it lays them, one rank per stage (every rank already holds a slice of every part of the
    pipeline), each copy of the stages on ranks of its own laid out so (:func:`_copy_pipelines`), on
    microbatches its order can play; a package laid out so runs only under such a schedule, whose
    order it was planned for."""
    kind, layout = get_schedule(job.schedule), job.copy_layout
    pipes = _copy_pipelines(layout)
    fits = _laid_out_by(pipes[0]) if pipes else []
    if kind.placement is None:
        if job.virtual_stages > 1:
            raise RunError(
                f"{job.package} puts {job.virtual_stages} stages on each rank, which only --schedule "
                f"{' or '.join(fits) or 'interleaved or zbv'} runs, not {job.schedule}"
            )
        return
    if pipes is None:
        raise RunError(
            f"--schedule {job.schedule} runs a stage's replicas only as whole copies of the pipeline "
            f"(every stage with as many, each rank one copy's): {job.package} has stages on ranks "
            f"{[list(r) for r in job.stage_ranks]}; partition with --schedule {job.schedule}, or pick "
            "1f1b for replicated stages"
        )
    if job.schedule not in fits:
        others = " or ".join(fits)
        laid = f", laid out as only --schedule {others} runs them" if job.virtual_stages > 1 else ""
        raise RunError(
            f"--schedule {job.schedule} needs a package partitioned with --schedule {job.schedule}; "
            f"{job.package} has {job.stages} stages on ranks {[list(r) for r in layout]}{laid}"
        )
    copies = len(pipes)
    for i in range(copies):
        own = len(range(i, job.microbatches, copies))
        try:
            kind.check(len({r for rs in pipes[i] for r in rs}), job.virtual_stages, own)
        except ScheduleError as exc:
            each = f"each of the {copies} copies runs {own} of the {job.microbatches} microbatches: "
            raise RunError((each if copies > 1 else "") + str(exc)) from exc


def _copy_pipelines(layout: Layout) -> tuple[Layout, ...] | None:
    """Each copy's pipeline, its ranks numbered from 0 in order, where every stage has the same
    copies and no rank holds two copies' stages (copy ``i`` of every stage runs the microbatches
    ``j mod d == i``: the copies are whole pipelines of their own); None otherwise."""
    copies = len(layout[0]) if layout else 0
    if any(len(rs) != copies for rs in layout):
        return None
    used = [{rs[i] for rs in layout} for i in range(copies)]
    if sum(len(u) for u in used) != len(set().union(*used)):
        return None
    pipes = []
    for i in range(copies):
        dense = {r: n for n, r in enumerate(sorted(used[i]))}
        pipes.append(tuple((dense[rs[i]],) for rs in layout))
    return tuple(pipes)


def _check_3d(job: JobConfig) -> None:
    """What the 3D runtime does not run, refused in one line each (docs/layout-3d.md)."""
    if not job.is_3d:
        return
    kind = get_schedule(job.schedule)
    split = [k for k in range(job.stages) if job.layout(k).tensor_parallel > 1]
    shard = [k for k in range(job.stages) if job.layout(k).shard != "none"]
    if kind.stashes:
        raise RunError(
            f"--schedule {job.schedule} keeps weight versions per replica and runs neither tensor "
            f"parallelism nor sharding (stages {sorted(set(split + shard))}); pick 1f1b, gpipe, zb1p, "
            "interleaved or zbv"
        )
    if job.precision == "fp16":
        raise RunError("--precision fp16 does not run 3D layouts yet (its loss scale); use bf16 or fp32")
    tied = sorted({s for tie in job.ties for s, _ in tie if job.layout(s).is_3d})
    if tied:
        raise RunError(
            f"stages {tied} hold tied weights, which 3D layouts do not run yet; partition with t = 1"
        )
