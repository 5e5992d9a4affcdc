"""Feed a run's measured stage times back into its profile: metrics.json + plan.json -> Profile.

The profiler times each layer alone, in one process, at the profiled batch size. A training run
measures every stage as it really runs: with the rank's threads, at the microbatch size, next to the
other ranks, with its optimizer step. Scaling each stage's layers by measured / profiled keeps the
per-layer shape the profiler found and makes the next ``pipeplan partition`` predict what this
cluster does. Pure Python, no torch: the inputs are JSON files.

Example:
    >>> calibrated = calibrate(profile, plan, {0: 0.52, 1: 0.61}, batch_size=profile.batch_size)
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from partitioner.errors import PipeplanError
from partitioner.graph import SPLIT_BACKWARD, Node, Profile, at_microbatches, load_profile, save_profile
from partitioner.hardware.devices import DeviceModel, estimated_device, save_device_model
from partitioner.optimizer.pricing.schedules import model, priced_profile
from partitioner.plan import Plan, load_plan
from partitioner.profiler.update_cost import with_update_time
from runtime.files.find_newest import newest
from runtime.files.formats import METRICS_FIELDS
from runtime.files.schema import SchemaError, check
from runtime.schedule import REGISTRY

__all__ = [
    "OTHER_LOAD_PER_CORE",
    "RUNS_AGREE",
    "Calibration",
    "Measured",
    "RunTimes",
    "calibrate",
    "calibrate_package",
    "calibrate_runs",
    "calibrated_device",
    "check_run",
    "device_seconds",
    "disagreement",
    "load_run_times",
    "load_verdict",
    "newest_run",
    "node_factors",
    "stage_factors",
]

#: load per core beyond the run's own ranks above which a run's times are not its own: other work
#: took turns on its cores, and a calibration from it predicts a machine that is not there
OTHER_LOAD_PER_CORE = 0.5

#: how far (relative) a run's median stage factor may sit from the runs' median before it is named
RUNS_AGREE = 0.15


@dataclass(frozen=True)
class RunTimes:
    """What calibration needs from a metrics.json.

    Attributes:
        stage_s: compute seconds per minibatch of each stage, its replicas summed.
        batch_size: samples per minibatch of the run (None when the file does not say).
        source: the file it came from.
        model: the model spec of the package that ran (empty in files written before it was recorded).
        cpu_share: per stage, the share of a core its CPU ranks had while computing (where recorded).
        precision: what the run computed in (fp32 in files written before it was recorded).
        load: the machine's 1-minute load average as the run ended (None: not recorded).
        cpus: the cores the run could use (None: not recorded).
        hosted: for a rank that ran several stages (interleaved, zbv), the stage its time is filed
            under -> every stage it ran; such a rank times its stages together.
    """

    stage_s: Mapping[int, float]
    batch_size: int | None
    source: str
    model: str = ""
    cpu_share: Mapping[int, float] = field(default_factory=dict)
    precision: str = "fp32"
    load: float | None = None
    cpus: int | None = None
    hosted: Mapping[int, tuple[int, ...]] = field(default_factory=dict)


def load_run_times(path: str | os.PathLike[str]) -> RunTimes:
    """Read the per-stage compute seconds per minibatch that ``pipeplan run`` wrote.

    Raises:
        PipeplanError: the file is missing, not JSON, or not a pipeplan metrics file with stage times.
    """
    source = Path(path)
    try:
        doc = json.loads(source.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise PipeplanError(f"no {source}: train the package first (`pipeplan run`)") from exc
    except (OSError, ValueError) as exc:
        raise PipeplanError(f"cannot read {source}: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("schema") != "pipeplan.metrics/1" or not doc.get("stages"):
        raise PipeplanError(f"{source} is not a pipeplan metrics.json with per-stage times")
    try:
        check(doc, METRICS_FIELDS, str(source))
    except SchemaError as exc:
        raise PipeplanError(
            f"{exc}; calibrate from the metrics.json a finished `pipeplan run` wrote"
        ) from None
    hosted = _hosted(doc)
    kind = REGISTRY.get(str(doc.get("schedule")))
    if kind is not None and kind.placement is not None and not hosted:  # several stages on each rank
        raise PipeplanError(
            f"{source} is an {doc['schedule']} run that does not say which stages each rank ran (written "
            "before metrics.json recorded it): run the package again, or calibrate from a 1f1b run"
        )
    stage_s = {int(s["stage"]): float(s["compute_s_per_minibatch"]) for s in doc["stages"]}
    rate, step = doc.get("samples_per_s"), doc.get("time_per_minibatch_s")
    batch = doc.get("batch_size") or (round(rate * step) if rate and step else None)
    shares = ((int(s["stage"]), s.get("compute_cpu_share")) for s in doc["stages"])
    share = {stage: float(value) for stage, value in shares if value}
    model, precision = str(doc.get("model") or ""), str(doc.get("precision") or "fp32")
    batch_size = int(batch) if batch else None
    machine = doc.get("machine") or {}
    load, cpus = machine.get("loadavg_1min"), machine.get("cpus")
    return RunTimes(
        stage_s, batch_size, str(source), model, cpu_share=share, precision=precision,
        load=float(load) if load is not None else None, cpus=int(cpus) if cpus else None,
        hosted=hosted,
    )  # fmt: skip


def _hosted(doc: Mapping[str, object]) -> dict[int, tuple[int, ...]]:
    """The ranks of a metrics document that ran several stages: the stage each one's time is filed
    under (its first) -> all of them."""
    ranks = doc.get("ranks")
    out: dict[int, tuple[int, ...]] = {}
    for rank in ranks if isinstance(ranks, list) else ():
        stages = rank.get("hosted") if isinstance(rank, dict) else None
        if isinstance(stages, list) and len(stages) > 1 and all(isinstance(k, int) for k in stages):
            out[int(stages[0])] = tuple(stages)
    return out


def load_verdict(plan: Plan, run: RunTimes) -> tuple[str | None, list[str]]:
    """Whether the run's times are fit to calibrate from: (why not, or None; notes to show).

    The load average counts the run's own ranks (at most ``threads`` busy threads each, on the
    host that wrote the metrics); what is left over, per core, is other work that took turns on the
    ranks' cores. Above :data:`OTHER_LOAD_PER_CORE` the times are the contention's, not the plan's:
    refused. A stage whose ranks had under half a core while computing is named either way.
    """
    notes = [
        f"stage {k}: its ranks had {share:.0%} of a core while computing"
        for k, share in sorted(run.cpu_share.items())
        if share < 0.5
    ]
    if run.load is None or run.cpus is None:
        notes.append(
            f"{run.source} does not record the machine's load: cannot tell whether the run was quiet"
        )
        return None, notes
    own = min(plan.cluster.levels[0].devices, plan.gpus) * plan.cluster.threads
    others = max(0.0, run.load - own)
    notes.insert(
        0, f"the run ended at load {run.load:.2f} on {run.cpus} cores ({own} of it the run's own ranks)"
    )
    if others / run.cpus > OTHER_LOAD_PER_CORE:
        return (
            f"{run.source} was measured while other work loaded the machine (load {run.load:.1f} on "
            f"{run.cpus} cores, {others:.1f} beyond the run's {own} ranks): its times include waiting for "
            "a core. Run again on a quiet machine, or calibrate anyway with --accept-load",
            notes,
        )
    return None, notes


def device_seconds(plan: Plan, run: RunTimes) -> dict[int, float]:
    """The run's compute per stage in the sense of ``Stage.compute_s``: one device's own seconds.

    A plan that prices CPU ranks time-slicing their host's cores (``cluster.cores``) counts the
    sharing in its host bound, so the sharing comes out of the measured wall seconds here (times the
    share of a core the stage's ranks had); otherwise the wall seconds are the device's own.
    """
    if plan.cluster.cores is None:
        return dict(run.stage_s)
    return {k: s * run.cpu_share.get(k, 1.0) for k, s in run.stage_s.items()}


def stage_factors(
    profile: Profile,
    plan: Plan,
    measured_s: Mapping[int, float],
    hosted: Mapping[int, Sequence[int]] | None = None,
) -> dict[int, float]:
    """measured / profiled compute per stage, for the stages that were measured and have profiled time.

    A rank running several stages (``hosted``: the stage its time is filed under -> all of them)
    measured their sum, not each: every one of them takes the factor of the sum. The run cannot
    tell a slow chunk from a fast one; runs of other cuts, calibrated together, can.

    Raises:
        PipeplanError: the plan names nodes the profile lacks, or a measured stage is not in the plan.
    """
    ids = {n.id: n for n in profile.nodes}
    by_index = {s.index: s for s in plan.stages}
    for stage in plan.stages:
        missing = [n for n in stage.nodes if n not in ids]
        if missing:
            raise PipeplanError(f"the plan's stage {stage.index} names {missing[0]!r}, not in the profile")
    groups = {key: tuple((hosted or {}).get(key, (key,))) for key in measured_s}
    unknown = sorted({k for group in groups.values() for k in group} - set(by_index))
    if unknown:
        raise PipeplanError(f"the run measured stage {unknown[0]}, which the plan does not have")
    factors: dict[int, float] = {}
    for key, group in groups.items():
        profiled = math.fsum(ids[n].compute_ms for k in group for n in by_index[k].nodes) / 1e3
        if profiled > 0 and measured_s[key] > 0:
            factors.update({k: measured_s[key] / profiled for k in group})
    covered = {k for group in groups.values() for k in group}
    unmeasured = [s.index for s in plan.stages if s.index not in covered]
    if unmeasured:
        raise PipeplanError(
            f"the run measured no time for stage {unmeasured[0]} of the plan's {len(plan.stages)}, whose "
            "layers would keep their profiled times; calibrate from a run of this package"
        )
    return factors


@dataclass(frozen=True)
class Measured:
    """One run as calibration reads it: its plan, each stage's device seconds per minibatch (in the
    sense of ``Stage.compute_s``), its minibatch size (None: the profile's), where it came from, and
    the stages a rank timed together (:attr:`RunTimes.hosted`)."""

    plan: Plan
    seconds: Mapping[int, float]
    batch_size: int | None
    source: str = ""
    hosted: Mapping[int, tuple[int, ...]] = field(default_factory=dict)


def node_factors(profile: Profile, run: Measured) -> dict[str, float]:
    """measured / profiled compute of each layer of a measured stage (the stage's factor, taken for
    every layer in it), against the profile as the run's plan priced it
    (:func:`~partitioner.optimizer.pricing.schedules.priced_profile` at its microbatch count) and
    rescaled linearly to the profile's batch size when the run's minibatch differs."""
    plan = run.plan
    priced = priced_profile(profile, plan.schedule, model(plan.schedule).microbatches(plan.microbatches))
    scale = _batch_scale(profile, run)
    factors = stage_factors(priced, plan, run.seconds, run.hosted)
    return {n: factors[s.index] * scale for s in plan.stages if s.index in factors for n in s.nodes}


def calibrate_runs(profile: Profile, runs: Sequence[Measured]) -> Profile:
    """The profile with each layer's times scaled by the median of its factors over the runs that
    measured it (:func:`node_factors`); layers no run measured keep their times.

    One run's stage times carry that run's noise into every plan made from the result; the median
    of several runs (of different plans of the same profile, or the same plan run again) keeps a
    single slow or fast run from setting the scale. Each layer's fixed time per call and its times at
    each measured size are scaled with the rest, so the calibrated profile still prices other
    microbatch counts.

    A schedule that splits its backward (zb1p, zbv) runs the same layers slower than a fused backward
    on small layers (:func:`~partitioner.graph.split_backward`), so where runs of both kinds measured a
    layer its factor comes from the fused ones, and the split runs set the profile's split factor
    (:func:`split_factor`) instead of the layers'.
    """
    split = [REGISTRY[run.plan.schedule].split_backward for run in runs]
    fused_f = [node_factors(profile, run) for run, s in zip(runs, split, strict=True) if not s]
    split_f = [node_factors(profile, run) for run, s in zip(runs, split, strict=True) if s]
    factor_of = _medians(split_f) | _medians(fused_f)

    def scaled(n: Node) -> Node:
        f = factor_of[n.id]
        return replace(
            n,
            forward_ms=n.forward_ms * f,
            backward_ms=n.backward_ms * f,
            forward_fixed_ms=n.forward_fixed_ms * f,
            backward_fixed_ms=n.backward_fixed_ms * f,
            sized=tuple(replace(e, forward_ms=e.forward_ms * f, backward_ms=e.backward_ms * f,
                                input_ms=e.input_ms * f, weight_ms=e.weight_ms * f) for e in n.sized),
        )  # fmt: skip

    nodes = tuple(scaled(n) if n.id in factor_of else n for n in profile.nodes)
    notes = [
        {"metrics": run.source, "plan_stages": len(run.plan.stages), "factors": _stage_factors(profile, run)}
        for run in runs
    ]
    done = replace(profile, nodes=nodes, extra={**dict(profile.extra), "calibrated": {"runs": notes}})
    fused_layers = {n for f in fused_f for n in f}
    measured = split_factor(done, [run for run, s in zip(runs, split, strict=True) if s], fused_layers)
    if measured is None:
        return done
    factor, counted = measured
    return replace(done, extra={**dict(done.extra), SPLIT_BACKWARD: {"factor": factor, "runs": counted}})


def _batch_scale(profile: Profile, run: Measured) -> float:
    """The profile's minibatch over the run's: a run of another batch size is rescaled linearly."""
    return (profile.batch_size / run.batch_size) if profile.batch_size and run.batch_size else 1.0


def _medians(per_run: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per layer, the median of its factors over the runs that measured it."""
    return {n: statistics.median(f[n] for f in per_run if n in f) for n in {n for f in per_run for n in f}}


def split_factor(calibrated: Profile, runs: Sequence[Measured], fused: set[str]) -> tuple[float, int] | None:
    """(g, runs it came from): the median over the split-backward ``runs``' stages whose layers all
    took their factors from fused runs (``fused``) of (measured - forward) / backward, the stage's
    forward and backward priced by ``calibrated`` at the run's microbatches; None where no stage
    qualifies. A rank that ran several stages counts once, with their sums."""
    ratios: list[float] = []
    counted = 0
    for run in runs:
        plan, before = run.plan, len(ratios)
        forwards = model(plan.schedule).microbatches(plan.microbatches)
        at = {n.id: n for n in at_microbatches(calibrated, forwards).nodes}
        scale = _batch_scale(calibrated, run)
        by_index = {s.index: s for s in plan.stages}
        for key, seconds in run.seconds.items():
            layers = [n for k in run.hosted.get(key, (key,)) for n in by_index[k].nodes]
            if not layers or not fused.issuperset(layers):
                continue
            forward = math.fsum(at[n].forward_ms for n in layers) / 1e3
            backward = math.fsum(at[n].backward_ms for n in layers) / 1e3
            if backward > 0 and seconds > 0:
                ratios.append((seconds * scale - forward) / backward)
        counted += len(ratios) > before
    return (statistics.median(ratios), counted) if ratios else None


def _stage_factors(profile: Profile, run: Measured) -> dict[int, float]:
    """A run's factor per stage (the one :func:`node_factors` gave each of the stage's layers)."""
    factors = node_factors(profile, run)
    return {s.index: factors[s.nodes[0]] for s in run.plan.stages if s.nodes and s.nodes[0] in factors}


def calibrate(
    profile: Profile, plan: Plan, measured_s: Mapping[int, float], batch_size: int | None, source: str = ""
) -> Profile:
    """The profile with each measured stage's layer times scaled to what one run measured
    (:func:`calibrate_runs` of that run alone)."""
    return calibrate_runs(profile, [Measured(plan, measured_s, batch_size, source)])


def disagreement(profile: Profile, runs: Sequence[Measured]) -> str | None:
    """A note when the runs' median stage factors differ by more than :data:`RUNS_AGREE` from
    their median: the runs measured different machines (load, clock), not only different plans."""
    factors = [(run.source, _stage_factors(profile, run).values()) for run in runs]
    medians = [(source, statistics.median(f)) for source, f in factors if f]
    if len(medians) < 2:
        return None
    middle = statistics.median(m for _, m in medians)
    off = [(source, m) for source, m in medians if abs(m / middle - 1) > RUNS_AGREE]
    if not off:
        return None
    named = ", ".join(f"{source} {m:.2f}x" for source, m in off)
    return (
        f"the runs disagree: their median factor is {middle:.2f}x but {named}; each layer takes the "
        "median of its runs, so add runs measured on a quiet machine to outvote them"
    )


def calibrated_device(profile: Profile, runs: Sequence[Measured], source: str = "") -> DeviceModel | None:
    """For a profile estimated for a device model (``--device-model``), that model corrected by the
    runs: its efficiencies divided, and its launch time multiplied, by the median of the stages'
    measured / estimated compute over all runs, so the next estimate with it predicts what they
    measured. None for a measured profile, or when no stage was measured.

    One factor for the whole device: a run measures stages, not kernels, so it cannot tell a slow
    matrix product from a slow copy; the per-stage spread is in the calibrated profile itself.
    """
    device = estimated_device(profile)
    factors = [f for run in runs for f in _stage_factors(profile, run).values()]
    if device is None or not factors:
        return None
    return device.scaled(statistics.median(factors), f"calibrated from {source or 'a run'}")


@dataclass(frozen=True)
class Calibration:
    """What ``pipeplan calibrate`` wrote and shows: the profile as the plans priced it (with the update
    time), each run (plan and measured seconds), the calibrated profile's path and, for a profile
    estimated for a device model, the corrected device model's path; notes on the runs' load and
    agreement; and the split-backward factor the result prices zb1p and zbv with (``{"factor": g,
    "runs": n}``, :func:`split_factor`), if it has one."""

    profile: Profile
    runs: tuple[Measured, ...]
    path: Path
    device: DeviceModel | None = None
    device_path: Path | None = None
    notes: tuple[str, ...] = ()
    split_backward: Mapping[str, float] | None = None


def calibrate_package(
    folders: Sequence[Path],
    metrics: str | os.PathLike[str] | None = None,
    output: str | os.PathLike[str] | None = None,
    accept_load: bool = False,
) -> Calibration:
    """Packages' runs (``metrics``, default ``folder/run/metrics.json``; one package only when given)
    -> their profile calibrated by all of them (:func:`calibrate_runs`), written to ``output``
    (default: calibrated.json beside the profile), and a device model where the profile was
    estimated for one. The packages must be plans of one profile under one optimizer. A run
    measured under other work's load is refused (:func:`load_verdict`) unless ``accept_load``.
    Everything is read and checked before anything is written."""
    if metrics is not None and len(folders) != 1:
        raise PipeplanError("--metrics and --run-dir name one run: give one package with them")
    plans = [_plan_of(folder) for folder in folders]
    first = plans[0]
    for folder, plan in zip(folders[1:], plans[1:], strict=True):
        if (plan.profile, plan.optimizer) != (first.profile, first.optimizer):
            raise PipeplanError(
                f"{folder} was planned from {plan.profile} ({plan.optimizer}), {folders[0]} from "
                f"{first.profile} ({first.optimizer}): calibrate the runs of one profile and optimizer "
                "together"
            )
    profile = with_update_time(load_profile(first.profile), first.optimizer)  # as partition priced it
    runs: list[Measured] = []
    notes: list[str] = []
    for folder, plan in zip(folders, plans, strict=True):
        run = load_run_times(metrics or folder / "run" / "metrics.json")
        check_run(folder, plan, profile, run)
        refusal, said = load_verdict(plan, run)
        if refusal is not None and not accept_load:
            raise PipeplanError(refusal)
        notes += said
        runs.append(Measured(plan, device_seconds(plan, run), run.batch_size, run.source, run.hosted))
    spread = disagreement(profile, runs)
    result = calibrate_runs(profile, runs)
    path = Path(output) if output else Path(first.profile).with_name("calibrated.json")
    save_profile(result, path)
    device = calibrated_device(profile, runs, ", ".join(run.source for run in runs))
    where = save_device_model(device, path.with_name(f"{device.name}-calibrated.json")) if device else None
    split = result.extra.get(SPLIT_BACKWARD)
    remarks = (*notes, *([spread] if spread else []))
    return Calibration(profile, tuple(runs), path, device, where, remarks, split)


def _plan_of(folder: Path) -> Plan:
    plan = load_plan(folder / "plan.json")
    if not plan.profile:
        raise PipeplanError(f"{folder}/plan.json does not name the profile it was planned from")
    return plan


def check_run(folder: Path, plan: Plan, profile: Profile, run: RunTimes) -> None:
    """Refuse a run of another model or placement, or at another precision than the profile's: its
    stage times would calibrate the profile to something it does not describe."""
    if run.model and plan.model and run.model != plan.model:
        raise PipeplanError(
            f"{run.source} measured {run.model}, but {folder} is a package of {plan.model}; "
            "give the metrics of a run of this package (PACKAGE/run/metrics.json)"
        )
    ranks = {s.index: s.ranks for s in plan.stages}
    for first, group in run.hosted.items():
        if any(ranks.get(k) != ranks.get(first) for k in group) or first not in ranks:
            raise PipeplanError(
                f"{run.source} has a rank that ran stages {', '.join(map(str, group))}, which {folder} "
                "does not place on one rank: give the metrics of a run of this package"
            )
    if run.precision != profile.precision:
        raise PipeplanError(
            f"{run.source} trained at {run.precision}, but {plan.profile} was measured at "
            f"{profile.precision}: calibrate from a run with --precision {profile.precision}, or profile "
            f"with --precision {run.precision}"
        )


def newest_run(models_dir: str | os.PathLike[str]) -> Path:
    """The package whose run finished last under ``models_dir`` (what calibrate reads by default)."""
    missing = PipeplanError(f"no package under {models_dir}/ has a run/metrics.json; train one: pipeplan run")
    return newest(models_dir, "**/run/metrics.json", missing).parent.parent
