"""What every rank runs: join the job, build its stage, play its schedule segment by segment.

Started by :func:`runtime.job.launch.launch` (elastic launch) or by ``torchrun -m runtime.job.worker PACKAGE
...`` on each node; both set RANK/WORLD_SIZE/LOCAL_RANK and the rendezvous store in the environment.
Rank 0 gathers every rank's metrics at the end and writes ``metrics.json`` (and the merged trace).
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runtime import schedule
from runtime.checkpoints.rank_side import RankCheckpoints
from runtime.datasets.minibatches import make_batches
from runtime.datasets.user_data import DataSettings
from runtime.errors import PeerLost, RunError
from runtime.executing.comm import Comm
from runtime.executing.evaluate import EvalResult, Evaluator, eval_steps, segments
from runtime.executing.loss_scale import LossScaler
from runtime.executing.optimizer import Clip, OptimSettings, counted_params, make_optimizer, make_scheduler
from runtime.executing.stage import Batches, Groups, StageRuntime
from runtime.faults.die_with_launcher import die_with, wake_siblings
from runtime.faults.liveness import start_heartbeat
from runtime.faults.startup_checkin import CheckIn
from runtime.files.atomic import write_json_atomic
from runtime.job import stage3d
from runtime.job.step_log import StepLog, open_step_log
from runtime.observing.fidelity import stage_report
from runtime.observing.metrics import RankMetrics, Recorder, summarize, write_trace
from runtime.observing.peak_memory import PeakMemory, local, memory_report, stage_bytes
from runtime.observing.resident_memory import peak_resident_bytes, reset_peak, resident_bytes
from runtime.packages.job_config import JobConfig, RankConfig, load_job
from runtime.packages.load import build_stage, import_package, read_wiring
from runtime.settings.run_options import RunOptions, from_argv

__all__ = [
    "PEER_LOST_GRACE_S",
    "keep_freed_memory",
    "main",
    "resolve_backend",
    "run_dir",
    "run_rank",
    "share_cores",
]

log = logging.getLogger(__name__)

PEER_LOST_GRACE_S = 2.0
"""Seconds a rank that lost a peer waits before failing, so the peer's own error is the one reported."""


def resolve_backend(backend: str) -> str:
    """``auto`` means nccl when CUDA is available, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise RunError(f"unknown backend {backend!r}; choose auto, gloo or nccl")
    return backend


def run_dir(options: RunOptions) -> Path:
    """Where metrics.json, progress and logs of a run go."""
    return Path(options.run_dir) if options.run_dir else Path(options.package) / "run"


def job_of(options: RunOptions) -> JobConfig:
    return load_job(
        options.package, options.schedule, options.microbatches, options.batch_size, options.precision
    )


def _groups(cfg: RankConfig, timeout: timedelta) -> Groups:
    """Create every replica and tie group in the same order on all ranks; keep this rank's. Under
    ``interleaved`` a tie's members on this rank's stages are kept together (``rank_ties``)."""
    job, mine = cfg.job, None
    for k, ranks in enumerate(job.stage_ranks):
        if len(ranks) > 1 and not job.layout(k).is_3d:
            group = dist.new_group(list(ranks), timeout=timeout)
            mine = group if cfg.rank in ranks else mine
    ties, rank_ties = [], []
    hosted = {s for s, ranks in enumerate(job.stage_ranks) if cfg.rank in ranks}
    for tie in job.ties:
        members = sorted({r for stage, _ in tie for r in job.stage_ranks[stage]})
        group = dist.new_group(members, timeout=timeout)
        if job.virtual_stages > 1:
            here = tuple((stage, name) for stage, name in tie if stage in hosted)
            rank_ties += [(group if len(members) > 1 else None, here)] if here else []
        else:
            ties += [(group, name) for stage, name in tie if stage == cfg.stage]
    if not job.is_3d:
        return Groups(mine, tuple(ties), tuple(rank_ties))
    return stage3d.groups(Groups(mine, tuple(ties), tuple(rank_ties)), cfg, timeout)


def _total_steps(options: RunOptions, batches: Batches) -> int:
    """Minibatches of the whole run (counting those before a resume): where the schedule ends."""
    return options.steps if options.steps is not None else (options.epochs or 1) * batches.steps_per_epoch


def _clip(settings: OptimSettings, cfg: RankConfig, module: torch.nn.Module) -> Clip | None:
    """Global clipping over every rank (a rank started by torchrun gets no CLI check first)."""
    if settings.clip_grad_norm is None:
        return None
    settings.check_schedule(cfg.job.schedule)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    return Clip(settings.clip_grad_norm, counted_params(cfg, names), dist.group.WORLD)  # type: ignore[arg-type]


@dataclass
class _Clock:
    """Step boundaries of one rank, and progress lines written by the loss-reporting rank."""

    progress: Path | None
    last: float = 0.0
    memory: PeakMemory | None = None
    log: StepLog | None = None
    built: list[tuple[int, int | None]] = field(default_factory=list)  # (stage bytes, RSS peak growth)

    def __post_init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []
        self.evals: list[EvalResult] = []
        self.checkpoints: list[tuple[int, float]] = []
        self.start()

    def start(self) -> None:
        """The first step begins now."""
        self.last = time.perf_counter()
        self.cpu_start = time.process_time()

    def __call__(self, steps: tuple[int, ...], losses: tuple[float, ...] | None) -> None:
        """An optimizer step covering ``steps`` ended: its time is shared evenly by its minibatches."""
        now = time.perf_counter()
        if self.memory is not None:
            self.memory.stepped(len(steps))
        self.times += [(now - self.last) / len(steps)] * len(steps)
        if self.log is not None:
            self.log.record(steps, now - self.last, losses)
        self.last = now
        for step, loss in zip(steps, losses or (), strict=False):
            if not math.isfinite(loss):
                raise RunError(
                    f"the loss is {loss} at step {step + 1}: training diverged; lower --lr, or check the data"
                )
            self.losses.append(loss)
            self._write({"step": step + 1, "loss": loss})

    def evaluated(self, result: EvalResult | None, seconds: float) -> None:
        """Leave an evaluation's ``seconds`` out of the next step's time; keep its result (the reporting
        rank's) and show it in the progress line."""
        self.last += seconds
        if result is not None:
            self.evals.append(result)
            last = self.losses[-1] if self.losses else float("nan")
            self._write({"step": result.step, "loss": last, "eval": result.record()})

    def saved(self, step: int, seconds: float) -> None:
        """Rank 0: the checkpoint of ``step`` is complete on disk, ``seconds`` after it began."""
        self.checkpoints.append((step, seconds))

    def _write(self, line: dict[str, Any]) -> None:
        if self.progress is not None:
            with self.progress.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(line) + "\n")


def _warn_idle_replicas(job: JobConfig) -> None:
    """Synchronous schedules split a minibatch's microbatches over a stage's replicas (pipedream
    hands out whole minibatches, so every replica gets work)."""
    if not schedule.get_schedule(job.schedule).flushes:
        return
    for k, ranks in enumerate(job.stage_ranks):
        if len(ranks) > job.microbatches:
            log.warning(
                "stage %d has %d replicas but a minibatch has only %d microbatches: %d replicas idle; "
                "use --microbatches %d or more",
                k, len(ranks), job.microbatches, len(ranks) - job.microbatches, len(ranks),
            )  # fmt: skip


def _build_hosted(
    options: RunOptions,
    configs: tuple[RankConfig, ...],
    device: torch.device,
    clock: _Clock,
    checkin: CheckIn,
) -> tuple[StageRuntime, ...]:
    """This rank's runtimes: one, or under ``interleaved`` one per chunk, sharing the first one's
    channels, groups, recorder and data. Only the last takes ``clock``: a rank's minibatch ends
    with its last chunk's step. The groups come first: their creation waits on every rank, the
    building after it does not (start-up steps 2 and 3 of :class:`CheckIn`)."""
    with checkin.waiting("creating the replica and tie groups"):
        groups = _groups(configs[0], timedelta(seconds=options.timeout))
    checkin.done(2)
    only = clock if len(configs) == 1 else None
    first = _build(options, configs[0], device, only, groups=groups, built=clock.built)
    rest = tuple(
        _build(options, cfg, device, clock if i == len(configs) - 2 else None, first, built=clock.built)
        for i, cfg in enumerate(configs[1:])
    )
    hosted = tuple(stage3d.hooked(rt) for rt in (first, *rest))
    for rt in hosted[:-1]:
        rt.ends_minibatch = False
    if rest:  # the rank's first step unscales (fp16) and clips every chunk's gradients at once
        first.chunks = hosted
        for rt in rest:
            rt.lead, rt.clip = first, None
    if first.clip is not None and rest:  # (a tied weight counted once, by the first stage holding it)
        names = {
            f"{rt.cfg.stage}/{n}"
            for rt in hosted
            for n in counted_params(rt.cfg, [n for n, p in rt.module.named_parameters() if p.requires_grad])
        }
        first.clip = replace(first.clip, counted=frozenset(names))
    return hosted


def _build(
    options: RunOptions,
    cfg: RankConfig,
    device: torch.device,
    clock: _Clock | None,
    shared: StageRuntime | None = None,
    groups: Groups | None = None,
    built: list[tuple[int, int | None]] | None = None,
) -> StageRuntime:
    if cfg.rank == 0 and shared is None:
        _warn_idle_replicas(cfg.job)
    pkg = import_package(cfg.job.package)
    wiring = read_wiring(pkg, cfg.job.stages, cfg.job.module_stages)
    before = resident_bytes() if reset_peak() else None
    module = build_stage(pkg, wiring, cfg.stage, cfg.job.module_stages, options.seed, device, options.weights)
    held = groups if groups is not None else shared.groups if shared is not None else None
    if cfg.layout.is_3d and held is not None:  # split over tensor ranks, sharded over copies
        module = stage3d.distribute(module, cfg, held.meshes[cfg.stage], options)
    if built is not None:  # what building the stage cost the process, next to what the stage holds
        grown = peak_resident_bytes() - before if before is not None else None
        built.append((stage_bytes(module), grown))
    module.train()
    criterion = pkg.criterion().to(device) if cfg.is_last else None
    timeout = timedelta(seconds=options.timeout)
    names, reading = wiring.stage_inputs[0], DataSettings.of(options, cfg.job)
    batches = (
        shared.batches
        if shared is not None
        else make_batches(
            options.data, pkg, names, cfg.job.batch_size, options.seed, options.shuffle, reading
        )
    )
    settings = options.optim
    optimizer = make_optimizer(settings, module.parameters())
    return StageRuntime(
        cfg=cfg,
        wiring=wiring,
        module=module,
        criterion=criterion,
        optimizer=optimizer,
        scheduler=make_scheduler(settings, optimizer, _total_steps(options, batches)),
        clip=_clip(settings, cfg, module),
        comm=shared.comm if shared else Comm(dist.group.WORLD, device, prefetch=device.type == "cpu"),  # type: ignore[arg-type]
        groups=stage3d.chunk_groups(shared.groups, cfg) if shared else groups or _groups(cfg, timeout),
        batches=batches,
        stash=schedule.get_schedule(cfg.job.schedule).stashes,
        recorder=shared.recorder
        if shared
        else Recorder(cfg.rank, cfg.stage, trace=options.trace is not None),
        on_step=clock,
        precision=cfg.job.precision,
        scaler=shared.scaler if shared else _scaler(cfg),
    )


def _scaler(cfg: RankConfig) -> LossScaler | None:
    """fp16's loss scaler (one per rank: its chunks share it under interleaved)."""
    return LossScaler(dist.group.WORLD) if cfg.job.precision == "fp16" else None  # type: ignore[arg-type]


def _segments(start: int, total: int, every: int) -> list[tuple[int, int]]:
    """(first step, steps) runs between checkpoints; a pipeline drains at each boundary."""
    return segments(start, total, range(start, total, every) if every > 0 else ())


def _evaluator(options: RunOptions, hosted: tuple[StageRuntime, ...]) -> Evaluator | None:
    """The held-out data of ``--eval-data`` (on every rank: the middle stages need its length).
    Synthetic held-out data is drawn with another seed than training's."""
    if options.eval_data is None:
        return None
    rt = hosted[0]
    pkg, job = import_package(rt.cfg.job.package), rt.cfg.job
    seed = options.seed + 1 if options.eval_data == "synthetic" else options.seed
    settings = DataSettings.of(options, job)
    data = make_batches(
        options.eval_data, pkg, rt.wiring.stage_inputs[0], job.batch_size, seed, False, settings
    )
    return Evaluator(rt, data, data.steps_per_epoch, hosted if len(hosted) > 1 else ())


def _train(
    options: RunOptions,
    hosted: tuple[StageRuntime, ...],
    total: int,
    saves_to: RankCheckpoints | None,
    checkin: CheckIn,
) -> None:
    rt = hosted[0]
    job, cfg = rt.cfg.job, rt.cfg
    with checkin.waiting("agreeing on the step to start from"):
        start, set_rng = saves_to.resume() if saves_to is not None else (0, lambda: None)
    checkin.done(4)
    for each in hosted:
        each.setup()
    checkin.done(5)
    set_rng()
    clock = hosted[-1].on_step if isinstance(hosted[-1].on_step, _Clock) else None
    step_log = open_step_log(options, hosted, run_dir(options), total)
    if clock is not None:
        clock.log = step_log
        clock.memory = PeakMemory(rt.comm.device, job.world_size + 1, cpu=options.measure_memory)
        clock.memory.start(rt.module, rt.optimizer)
        clock.start()
    evaluator = _evaluator(options, hosted)
    saves = {first + count for first, count in _segments(start, total, options.checkpoint_every)}
    evals = eval_steps(start, total, options.eval_every) if evaluator is not None else ()
    for first, count in segments(start, total, sorted(saves | set(evals))):
        steps = range(first, first + count)  # built as they are played: start-up and memory do not grow
        acts = schedule.actions(
            job.schedule, job.copy_layout, job.copy_rank(cfg.rank), job.microbatches, steps
        )
        rt.play(acts, first, hosted)
        if saves_to is not None and first + count in saves:
            began = time.perf_counter()
            saves_to.save(first + count)
            if clock is not None:
                clock.evaluated(None, time.perf_counter() - began)
        if evaluator is not None and first + count in evals:
            began = time.perf_counter()
            result = evaluator(first + count)
            if clock is not None:
                clock.evaluated(result, time.perf_counter() - began)
    step_log.close()


def share_cores() -> None:
    """Split this machine's cores among its ranks, as torchrun does with OMP_NUM_THREADS: ranks that
    each start one thread per core oversubscribe the CPU and spin against each other. An
    OMP_NUM_THREADS in the environment wins, applied here too: a rank forked from a process whose
    torch was already initialised would otherwise keep that process's thread count."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    given = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(
        int(given) if given.isdigit() and int(given) > 0 else max(1, (os.cpu_count() or 1) // local)
    )


def keep_freed_memory() -> None:
    """Stop glibc from handing freed heap back to the kernel (CPU ranks). Every step frees and
    reallocates the same megabytes of gradients and activations; with glibc's default thresholds the
    top of the heap is trimmed at each free and faulted back in on the next step (2-4 thousand
    minor faults, about 8 ms of kernel time per step on the benchmark MLP, where a step is ~80 ms).
    Allocations up to 32 MiB (glibc's ceiling) then come from the heap instead of fresh mmaps."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 1 << 30)


def run_rank(options: RunOptions) -> dict[str, Any] | None:
    """Train this rank's stage; rank 0 returns the metrics.json document, the others None."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    job = job_of(options)
    if world != job.world_size:
        raise RunError(f"{job.package} runs on {job.world_size} ranks but the job has {world}")
    die_with(options.launcher_pid or os.getppid())
    start_heartbeat(rank, options.timeout)
    backend = resolve_backend(options.backend)
    if backend == "nccl" and job.virtual_stages > 1 and world > 1:  # one rank: every message is loopback
        raise RunError(
            f"--schedule {job.schedule} runs on gloo only for now: its ranks tell their message streams "
            "apart by tag, which NCCL ignores; pass --backend gloo"
        )
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if backend == "nccl" else "cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
    share_cores()
    torch.manual_seed(options.seed)
    checkin = CheckIn.from_env(rank, world, options.timeout)
    checkin.done(0)
    # On error the group is left open: closing it would let peers fail first with "connection closed"
    # before this rank's error is on record; the process exit closes it a moment later.
    try:
        with checkin.waiting("joining the process group"):
            dist.init_process_group(backend, timeout=timedelta(seconds=options.timeout))
        checkin.done(1)
        return _run_joined(options, job.hosted(rank), device, checkin)
    except PeerLost:
        # Let the rank that really failed exit first: the agent reports the first failure it sees.
        # Then resume a stopped sibling, which the agent's SIGTERM could not end otherwise; woken, it
        # finds its own wait timed out and sleeps this same grace, so this rank's error is first.
        time.sleep(PEER_LOST_GRACE_S)
        wake_siblings()
        raise


def _run_joined(
    options: RunOptions, configs: tuple[RankConfig, ...], device: torch.device, checkin: CheckIn
) -> dict[str, Any] | None:
    cfg = configs[-1]
    progress = run_dir(options) / "progress.jsonl" if cfg.is_last and cfg.leads else None
    clock = _Clock(progress)
    hosted = _build_hosted(options, configs, device, clock, checkin)
    checkin.done(3)
    total = _total_steps(options, hosted[0].batches)
    with checkin.waiting("creating the checkpoint group"):
        saves_to = RankCheckpoints.open(options, hosted, total, clock.saved)
    _train(options, hosted, total, saves_to, checkin)
    if saves_to is not None:
        saves_to.close()
    result = _finish(options, hosted, clock)
    dist.destroy_process_group()
    return result


def _finish(options: RunOptions, hosted: tuple[StageRuntime, ...], clock: _Clock) -> dict[str, Any] | None:
    rt = hosted[0]
    memory = clock.memory or PeakMemory(rt.comm.device, 0)
    memory.stop()
    mine = RankMetrics(
        rank=rt.cfg.rank,
        stage=rt.cfg.stage,
        wall_s=sum(clock.times),
        compute_s=rt.recorder.seconds["compute"],
        comm_s=rt.comm.seconds,
        step_times_s=tuple(clock.times),
        step_compute_s=rt.recorder.step_compute_s(),
        step_comm_s=rt.recorder.step_comm_s(),
        compute_cpu_s=rt.recorder.cpu_seconds["compute"],
        cpu_s=time.process_time() - clock.cpu_start,
        sends_in_flight_max=rt.comm.peak_pending,
        threads=torch.get_num_threads(),
        losses=tuple(clock.losses) if rt.cfg.replica == 0 else (),
        param_sq_sum=float(
            sum(
                local(p.detach()).double().square().sum() for each in hosted for p in each.module.parameters()
            )
        ),
        versions_in_flight_max=rt.versions_in_flight_max,
        loss_scale=rt.scaler.scale if rt.scaler is not None else None,
        overflow_steps=tuple(rt.overflow_steps),
        skipped_steps=tuple(rt.skipped_steps),
        peak_memory_bytes=memory.peak_bytes,
        hosted=tuple(each.cfg.stage for each in hosted) if len(hosted) > 1 else (),
        stage_bytes=sum(size for size, _ in clock.built),
        build_growth_bytes=max((g for _, g in clock.built if g is not None), default=None),
        resident_peak_bytes=peak_resident_bytes(),
    )
    gathered: list[Any] = [None] * rt.cfg.job.world_size
    dist.gather_object(
        (mine, rt.recorder.events, rt.stash_log, rt.step_versions, [e.record() for e in clock.evals]),
        gathered if rt.cfg.rank == 0 else None,
        dst=0,
    )
    if rt.cfg.rank != 0:
        return None
    warmup = 1 if len(clock.times) >= 3 else 0
    doc = summarize([g[0] for g in gathered], rt.cfg.job.batch_size, rt.cfg.job.predicted_time_s, warmup)
    doc["stages"] = stage_report(doc["stages"], [g[0] for g in gathered], rt.cfg.job.predicted_stages, warmup)
    doc.update(schedule=rt.cfg.job.schedule, microbatches=rt.cfg.job.microbatches, world_size=len(gathered))
    if clock.log is not None:
        doc.update(clock.log.summary(doc["time_per_minibatch_s"]))
    doc["checkpoints"] = [{"step": step, "seconds": seconds} for step, seconds in clock.checkpoints]
    doc.update(device=rt.comm.device.type, precision=rt.cfg.job.precision)
    doc["model"] = rt.cfg.job.model
    doc["stash_log"] = {g[0].rank: g[2] for g in gathered}
    doc["step_versions"] = {g[0].rank: g[3] for g in gathered}
    doc["eval"] = [e for g in gathered for e in g[4]]
    peaks = [(g[0].stage, g[0].peak_memory_bytes) for g in gathered]
    doc["memory"] = memory_report(
        peaks,
        _rank_predictions(rt.cfg.job, [g[0] for g in gathered]),
        memory.method,
        memory.measured_minibatches,
    )
    write_json_atomic(run_dir(options) / "metrics.json", doc)
    if options.trace:
        write_trace(Path(options.trace), [g[1] for g in gathered])
    return doc


def _rank_predictions(job: JobConfig, ranks: list[RankMetrics]) -> tuple[int, ...]:
    """plan.json's predicted peak per stage, where a rank hosting several stages (interleaved, zbv)
    reports its peak under its first stage: there the sum of its stages' (one device holds them all,
    as the planner checks it)."""
    predicted = list(job.predicted_memory_bytes)
    for r in ranks:
        if r.hosted and all(s < len(predicted) for s in r.hosted):
            predicted[r.stage] = sum(job.predicted_memory_bytes[s] for s in r.hosted)
    return tuple(predicted)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``torchrun ... -m runtime.job.worker PACKAGE [options]`` on each node."""
    run_rank(from_argv(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
