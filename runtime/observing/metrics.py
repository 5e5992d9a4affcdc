"""Per-rank timing (compute, communication, idle), losses, and the merged Chrome trace of all ranks.

Each rank records spans with :class:`Recorder`; at the end rank 0 gathers every rank's
:class:`RankMetrics` and writes ``metrics.json`` and, if asked, one Chrome trace (``traceEvents``, one
process per rank) that opens in Perfetto or chrome://tracing.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runtime.files.atomic import write_json_atomic

__all__ = ["RankMetrics", "Recorder", "cpu_share", "summarize", "write_trace"]


@dataclass
class Recorder:
    """Spans of one rank; events are kept only when a trace is wanted."""

    rank: int
    stage: int
    trace: bool = False
    seconds: dict[str, float] = field(default_factory=lambda: {"compute": 0.0, "comm": 0.0})
    cpu_seconds: dict[str, float] = field(default_factory=lambda: {"compute": 0.0, "comm": 0.0})
    events: list[dict[str, Any]] = field(default_factory=list)
    step_marks: list[tuple[float, int]] = field(default_factory=list)
    comm_marks: list[tuple[float, int]] = field(default_factory=list)

    def mark_step(self, minibatches: int = 1, comm_s: float | None = None) -> None:
        """An optimizer step covering ``minibatches`` minibatches ended (a pipedream replica steps
        once per round of its stage's replicas): remember the compute seconds so far and, given,
        the seconds the rank's communication has been blocked so far (``Comm.seconds``)."""
        self.step_marks.append((self.seconds["compute"], minibatches))
        if comm_s is not None:
            self.comm_marks.append((comm_s, minibatches))

    def step_compute_s(self) -> tuple[float, ...]:
        """Compute seconds per minibatch (forward, backward and optimizer work between step marks,
        shared evenly by the minibatches a step covered)."""
        return _per_minibatch(self.step_marks)

    def step_comm_s(self) -> tuple[float, ...]:
        """Blocked communication seconds per minibatch, as :meth:`step_compute_s` shares them."""
        return _per_minibatch(self.comm_marks)

    @contextmanager
    def span(self, name: str, category: str) -> Iterator[None]:
        """Wall and CPU time of the block (CPU time of this thread: on a shared machine the gap
        between the two is time the rank was runnable but not running)."""
        start, cpu = time.time(), time.thread_time()
        try:
            yield
        finally:
            end = time.time()
            self.seconds[category] = self.seconds.get(category, 0.0) + end - start
            self.cpu_seconds[category] = self.cpu_seconds.get(category, 0.0) + time.thread_time() - cpu
            if self.trace:
                self.events.append(
                    {"name": name, "cat": category, "ph": "X", "pid": self.rank, "tid": self.stage,
                     "ts": start * 1e6, "dur": (end - start) * 1e6}
                )  # fmt: skip


def _per_minibatch(marks: Sequence[tuple[float, int]]) -> tuple[float, ...]:
    """Differences of a running total between step marks, each shared by the step's minibatches."""
    out: list[float] = []
    for (a, _), (b, n) in itertools.pairwise([(0.0, 1), *marks]):
        out += [(b - a) / n] * n
    return tuple(out)


@dataclass(frozen=True)
class RankMetrics:
    """What one rank measured over the timed steps.

    Attributes:
        rank: global rank.
        stage: the stage it ran.
        wall_s: seconds from the first to the last timed step boundary.
        compute_s: forward, backward and optimizer seconds.
        comm_s: seconds blocked in receives and all-reduces.
        compute_cpu_s: CPU seconds of the main thread within ``compute_s`` (less than ``compute_s``
            when other processes took the core).
        cpu_s: CPU seconds of the whole rank process (all threads, gloo's included) over the steps.
        sends_in_flight_max: the most sent tensors this rank kept alive at once, waiting to be known
            received (bounded by the schedule, not by the number of steps).
        threads: torch's intra-op threads in this rank.
        step_times_s: wall seconds of each step on this rank.
        step_compute_s: compute seconds of each step on this rank.
        step_comm_s: seconds of each step this rank was blocked in communication (empty: not
            recorded).
        losses: loss per step (last stage only, else empty).
        param_sq_sum: sum of squares of the stage's parameters at the end (replicas must agree exactly).
        versions_in_flight_max: the most weight versions this rank held at once (pipedream).
        loss_scale: fp16's loss scale at the end (None under fp32 and bf16).
        overflow_steps: steps (1-based) whose gradients on this rank held an inf or nan (fp16).
        skipped_steps: steps (1-based) that every rank skipped for an overflow on some rank (fp16).
        peak_memory_bytes: the rank's measured peak memory (``runtime.observing.peak_memory``; None:
            not measured).
        hosted: every stage the rank ran when it ran several (``interleaved``: ``stage`` is the first
            and the times are the rank's, all its stages together); empty otherwise.
        stage_bytes: bytes of the parameters and buffers the rank holds (all its stages).
        build_growth_bytes: how far building its stage raised the process's resident size at its
            highest (the stage's tensors and what building them needed for a while); None where the
            system cannot tell (Linux can).
        resident_peak_bytes: the process's highest resident size (RSS) from its stage build to the
            end of training: imports, its stage, activations and optimizer state, as the system
            counts them.
    """

    rank: int
    stage: int
    wall_s: float
    compute_s: float
    comm_s: float
    step_times_s: tuple[float, ...]
    step_compute_s: tuple[float, ...] = ()
    step_comm_s: tuple[float, ...] = ()
    compute_cpu_s: float = 0.0
    cpu_s: float = 0.0
    sends_in_flight_max: int = 0
    threads: int = 0
    losses: tuple[float, ...] = ()
    param_sq_sum: float = 0.0
    versions_in_flight_max: int = 0
    loss_scale: float | None = None
    overflow_steps: tuple[int, ...] = ()
    skipped_steps: tuple[int, ...] = ()
    peak_memory_bytes: int | None = None
    hosted: tuple[int, ...] = ()
    stage_bytes: int = 0
    build_growth_bytes: int | None = None
    resident_peak_bytes: int | None = None

    @property
    def idle_s(self) -> float:
        return max(0.0, self.wall_s - self.compute_s - self.comm_s)


def summarize(
    ranks: Sequence[RankMetrics], batch_size: int, predicted_s: float | None, warmup: int
) -> dict[str, Any]:
    """The metrics.json document: per-rank breakdown, losses, measured vs predicted time."""
    timed = [r.step_times_s[warmup:] or r.step_times_s for r in ranks]
    per_step = [max(ts[i] for ts in timed) for i in range(min(len(ts) for ts in timed))] if timed else []
    measured = statistics.median(per_step) if per_step else None
    losses = next((r.losses for r in ranks if r.losses), ())
    return {
        "schema": "pipeplan.metrics/1",
        "steps": len(losses),
        "losses": list(losses),
        "time_per_minibatch_s": measured,
        "predicted_time_per_minibatch_s": predicted_s,
        "ratio_measured_over_predicted": measured / predicted_s if measured and predicted_s else None,
        "batch_size": batch_size,
        "samples_per_s": batch_size / measured if measured else None,
        "warmup_steps_excluded": warmup,
        "stages": _stage_times(ranks, warmup),
        "ranks": [{**asdict(r), "idle_s": r.idle_s} for r in ranks],
        "machine": machine_load(),
    }


def machine_load() -> dict[str, Any]:
    """The 1-minute load average of the machine that writes the metrics (rank 0's) as the run ends,
    and the cores this process may use: ``calibrate`` tells a quiet run from one that shared its
    cores with other work (the run's own ranks count in the load too)."""
    return {"loadavg_1min": os.getloadavg()[0], "cpus": len(os.sched_getaffinity(0))}


def _stage_times(ranks: Sequence[RankMetrics], warmup: int) -> list[dict[str, Any]]:
    """Per stage, its compute seconds per minibatch on one device (replicas summed): the number the
    cost model's ``Stage.compute_s`` predicts, for calibrating profiles with measured times. The
    median step after the warm-up, as for the time per minibatch: the first step also allocates.
    ``compute_cpu_share``: CPU over wall seconds of its computing, below 1 where CPU ranks time-sliced
    their cores (what a plan that prices the host's cores must take out again)."""
    out = []
    for stage in sorted({r.stage for r in ranks}):
        mine = [r for r in ranks if r.stage == stage]
        per_rank = [
            statistics.median(r.step_compute_s[warmup:] or r.step_compute_s)
            if r.step_compute_s
            else r.compute_s / max(1, len(r.step_times_s))
            for r in mine
        ]
        wall, cpu = sum(r.compute_s for r in mine), sum(r.compute_cpu_s for r in mine)
        share = min(1.0, cpu / wall) if wall > 0 and cpu > 0 else None
        out.append({"stage": stage, "compute_s_per_minibatch": sum(per_rank), "compute_cpu_share": share})
    return out


def write_trace(path: Path, events_per_rank: Sequence[Sequence[dict[str, Any]]]) -> Path:
    """Merge every rank's spans into one Chrome trace, one named process per rank."""
    events: list[dict[str, Any]] = []
    for events_of_rank in events_per_rank:
        events.extend(dict(e) for e in events_of_rank)
    origin = min((e["ts"] for e in events), default=0.0)
    for e in events:
        e["ts"] -= origin
    names = {e["pid"]: e["tid"] for e in events}
    for rank, stage in sorted(names.items()):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": stage, "args": {"name": f"stage {stage}"}}
        )
    return write_json_atomic(path, {"traceEvents": events, "displayTimeUnit": "ms"})


def cpu_share(metrics: dict[str, Any]) -> float | None:
    """The share of a core the CPU ranks had while computing (their compute CPU time over wall time);
    None on GPUs or when the run recorded no CPU time."""
    ranks = metrics.get("ranks", [])
    wall = sum(float(r.get("compute_s", 0.0)) for r in ranks)
    cpu = sum(float(r.get("compute_cpu_s", 0.0)) for r in ranks)
    if metrics.get("device", "cpu") != "cpu" or wall <= 0 or cpu <= 0:
        return None
    return min(1.0, cpu / wall)
