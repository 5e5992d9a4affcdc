"""Correct a cluster file's latency from the messages a traced run timed: trace + plan -> cluster file.

``pipeplan probe`` measures a link between runs; a run's own messages cost what they cost beside its
computing. A run's Chrome trace (``pipeplan run --trace``) holds, per rank, each forward and
backward span (``F3``, ``B3``: the sender posts its message right after the span ends) and each
blocked receive (``recv F3`` on the next stage, ``recv B3`` on the previous one). Where the receiver
was already waiting when the sender posted, the receive ended when the message arrived: its wire
time is the receive's end less the sender's span end. Where the receiver was still computing, the
message may have arrived long before it looked, and its wire time is unknown: those are skipped,
never guessed.

The latency is the median over the timed messages of ``wire - bytes / bandwidth`` (each message's
bytes: the cut it crossed, per microbatch, from the plan's profile), so the bandwidth the file
already has is kept: one run sends one or two sizes per cut, too few to tell a latency from a
bandwidth. A message's time also holds the Python between the span's end and the send's post (tens
of microseconds) and the receiving thread's wake-up, both of which a run pays per message.

A replicated stage's gradient all-reduce is timed the same way: each step's ``all-reduce`` spans of
the stage's replicas, averaged. A replica waits in its all-reduce for the slowest one, so its span
is the collective plus (slowest compute - its own); their mean is the collective plus (slowest -
mean compute), which is what a step pays beyond the mean compute the plan charges its replicas.
The file's all-reduce latency per ring step becomes the median of ``(t - 4(r-1)P/(rB)) / (2(r-1))``
(``allreduce_time`` solved for its latency, P the stage's parameter bytes from the profile, B the
file's all-reduce bandwidth, kept): on CPU ranks gloo's all-reduce of a megabyte costs several
times what a message of its bytes does, and replicas sharing a host's cores drift apart.

The runtime's own time per action (``Cluster.action_s``) is the mean, over every forward, backward
and W span of the traced ranks, of the idle time from the span's end until the rank's next span
begins (a receive it blocks in, or its next action): Python between two actions, setting up autograd
and posting the action's messages, which no span covers and no layer's time holds. The mean, not the
median: it is what a step loses per action (on CPU ranks the gap before a receive the rank blocks
in is two to four times the gap before its next action: ``benchmarks/trace_gaps.py``). Each
rank's first fifth of traced time (start-up, the first steps) is skipped.

What this refuses, rather than guess: runs across hosts (their clocks differ, so one rank's
timestamps cannot be compared with another's), ranks hosting several stages (``interleaved``,
``zbv``: the trace names a rank's spans under its first stage) and traces with fewer than
:data:`FEWEST` timed messages. Pure Python, no torch: the inputs are JSON files.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partitioner.calibration.stage_times import Calibration, calibrate_package
from partitioner.errors import PipeplanError
from partitioner.graph import Profile, load_profile
from partitioner.hardware.clusters import cluster_from_json
from partitioner.optimizer.pricing.price import stage_loads
from partitioner.plan import Plan, load_plan
from runtime.files.atomic import write_json_atomic
from runtime.files.read_json import read_json

__all__ = [
    "FEWEST",
    "AllReduces",
    "LinkCalibration",
    "Messages",
    "action_gaps",
    "calibrate_with_links",
    "measure_links",
    "measure_runs",
    "message_bytes",
    "save_links",
    "timed_allreduces",
    "waited_messages",
]

#: the fewest timed messages a latency is taken from
FEWEST = 5


@dataclass(frozen=True)
class Messages:
    """A run's messages whose receiver was waiting when they were posted.

    Attributes:
        seconds: each one's wire time, post to arrival.
        nbytes: each one's bytes.
        skipped: messages whose receiver was still computing when they were posted (wire time unknown).
    """

    seconds: tuple[float, ...]
    nbytes: tuple[float, ...]
    skipped: int


@dataclass(frozen=True)
class AllReduces:
    """A run's gradient all-reduces, one per replicated stage and step: the mean of the replicas'.

    Attributes:
        seconds: each one's time.
        nbytes: the parameter bytes it reduced.
        replicas: the ranks it ran over.
    """

    seconds: tuple[float, ...]
    nbytes: tuple[float, ...]
    replicas: tuple[int, ...]


@dataclass(frozen=True)
class LinkCalibration:
    """A cluster file's level-0 latency, all-reduce latency and time per action before and after
    (None after: too few timed to say, kept), from how many messages, all-reduces and idle gaps
    after actions (``gaps``); ``doc``: the file."""

    cluster: Path
    latency_before_s: float
    latency_s: float | None
    bandwidth: float
    messages: Messages
    trace: str
    doc: Mapping[str, Any]
    allreduces: AllReduces = AllReduces((), (), ())
    allreduce_latency_before_s: float = 0.0
    allreduce_latency_s: float | None = None
    gaps: tuple[float, ...] = ()
    action_before_s: float = 0.0
    action_s: float | None = None

    @property
    def wire_median_s(self) -> float:
        return statistics.median(self.messages.seconds) if self.messages.seconds else math.nan


def _span_end(event: Mapping[str, Any]) -> float:
    return (float(event["ts"]) + float(event["dur"])) / 1e6


def waited_messages(events: Iterable[Mapping[str, Any]], nbytes: Sequence[tuple[float, float]]) -> Messages:
    """The wire time of every message in a trace whose receiver was waiting before it was posted.

    ``events``: the trace's complete spans (``pid`` rank, ``tid`` stage, ``ts``/``dur`` in us on one
    clock); ``nbytes[s]``: (bytes into stage ``s`` a forward, bytes into it a backward), per microbatch.
    """
    spans = [e for e in events if e.get("ph") == "X"]
    sent = {(int(e["tid"]), str(e["name"])): _span_end(e) for e in spans if e.get("cat") == "compute"}
    seconds, sizes, skipped = [], [], 0
    for e in spans:
        name = str(e["name"])
        if not name.startswith("recv ") or name[5:6] not in ("F", "B"):
            continue
        kind, stage = name[5], int(e["tid"])
        sender = stage - 1 if kind == "F" else stage + 1
        posted = sent.get((sender, name[5:]))
        if posted is None or not 0 <= stage < len(nbytes):
            continue
        if float(e["ts"]) / 1e6 > posted:
            skipped += 1  # still computing when it was sent: it may have waited in the receive buffer
            continue
        seconds.append(_span_end(e) - posted)
        sizes.append(nbytes[stage][0 if kind == "F" else 1])
    return Messages(tuple(seconds), tuple(sizes), skipped)


def timed_allreduces(events: Iterable[Mapping[str, Any]], stages: Sequence[tuple[int, float]]) -> AllReduces:
    """Per replicated stage and step, the mean of its replicas' ``all-reduce`` spans (the waiting for
    the slowest replica included: what the step pays beyond the replicas' mean compute).

    ``events``: the trace's spans (``pid`` rank, ``tid`` stage); ``stages[s]``: (replicas, parameter
    bytes) of stage ``s``. A rank's k-th all-reduce span is its k-th step's."""
    spans: dict[int, dict[int, list[float]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("name") == "all-reduce":
            stage = int(e["tid"])
            spans.setdefault(stage, {}).setdefault(int(e["pid"]), []).append(float(e["dur"]) / 1e6)
    seconds, sizes, widths = [], [], []
    for stage, ranks in sorted(spans.items()):
        if not 0 <= stage < len(stages) or stages[stage][0] < 2 or len(ranks) < 2:
            continue
        for step in zip(*ranks.values(), strict=False):
            seconds.append(statistics.fmean(step))
            sizes.append(stages[stage][1])
            widths.append(stages[stage][0])
    return AllReduces(tuple(seconds), tuple(sizes), tuple(widths))


def action_gaps(events: Iterable[Mapping[str, Any]]) -> tuple[float, ...]:
    """Seconds from the end of each forward, backward or W span to the start of its rank's next span
    (0 where they overlap), each rank's first fifth of traced time skipped: the runtime's own time
    between actions. ``events``: the trace's spans (``pid`` rank)."""
    ranks: dict[int, list[Mapping[str, Any]]] = {}
    for e in events:
        if e.get("ph") == "X":
            ranks.setdefault(int(e["pid"]), []).append(e)
    gaps = []
    for spans in ranks.values():
        spans.sort(key=lambda e: float(e["ts"]))
        first, last = float(spans[0]["ts"]), max(float(e["ts"]) + float(e["dur"]) for e in spans)
        kept = [e for e in spans if float(e["ts"]) >= first + 0.2 * (last - first)]
        for span, after in itertools.pairwise(kept):
            if span.get("cat") == "compute" and str(span["name"])[:1] in ("F", "B", "W"):
                gaps.append(max(0.0, float(after["ts"]) / 1e6 - _span_end(span)))
    return tuple(gaps)


def message_bytes(plan: Plan, profile: Profile) -> list[tuple[float, float]]:
    """Per stage, the bytes of one microbatch's message into it: (forward, backward); the profile's
    cut bytes scaled from its batch to the plan's microbatch."""
    loads = stage_loads(profile, [s.nodes for s in plan.stages])
    profiled = profile.batch_size or plan.batch_size or 1  # unknown on both sides: the same batch
    scale = (plan.batch_size or profiled) / profiled / plan.microbatches
    ins = [ld.in_bytes * scale for ld in loads] + [0.0]
    return [(ins[s], ins[s + 1]) for s in range(len(loads))]


def measure_links(
    folder: Path, trace: str | os.PathLike[str], cluster: str | os.PathLike[str]
) -> LinkCalibration:
    """:func:`measure_runs` of one traced run."""
    return measure_runs([(folder, trace)], cluster)


def measure_runs(
    runs: Sequence[tuple[Path, str | os.PathLike[str]]], cluster: str | os.PathLike[str]
) -> LinkCalibration:
    """``cluster``'s level-0 latency and all-reduce latency as the messages and all-reduces of traced
    runs (package folder, its run's trace) found them, pooled (nothing written: :func:`save_links`
    writes it). One run times what its plan does: a pipeline's messages, or a data-parallel plan's
    all-reduces; runs of both kinds together correct both figures.

    Raises:
        PipeplanError: a run this cannot read honestly (across hosts, several stages per rank), too
            few timed messages and all-reduces in all of them, or files that are not traces and a
            cluster file.
    """
    path = Path(cluster)
    doc = read_json(path, "the cluster file")
    known = cluster_from_json(doc, str(path))
    levels = known.levels
    readings = [_read_run(folder, trace, levels[0].devices) for folder, trace in runs]
    messages = Messages(
        tuple(t for m, _, _ in readings for t in m.seconds),
        tuple(b for m, _, _ in readings for b in m.nbytes),
        sum(m.skipped for m, _, _ in readings),
    )
    allreduces = AllReduces(
        tuple(t for _, a, _ in readings for t in a.seconds),
        tuple(b for _, a, _ in readings for b in a.nbytes),
        tuple(r for _, a, _ in readings for r in a.replicas),
    )
    gaps = tuple(g for _, _, gs in readings for g in gs)
    traces = ", ".join(str(trace) for _, trace in runs)
    if len(messages.seconds) < FEWEST and len(allreduces.seconds) < FEWEST:
        raise PipeplanError(
            f"{traces} {'has' if len(runs) == 1 else 'have'} {len(messages.seconds)} messages whose "
            f"receiver was waiting for them (of {len(messages.seconds) + messages.skipped}) and "
            f"{len(allreduces.seconds)} gradient all-reduces; at least {FEWEST} of either are needed: "
            "trace a longer run"
        )
    link = levels[0].link
    excess = [t - b / link.bandwidth for t, b in zip(messages.seconds, messages.nbytes, strict=True)]
    latency = max(0.0, statistics.median(excess)) if len(excess) >= FEWEST else None
    action = statistics.fmean(gaps) if len(gaps) >= FEWEST else None
    return LinkCalibration(
        path, link.latency, latency, link.bandwidth, messages, traces, doc,
        allreduces, link.sync_latency, _allreduce_latency(allreduces, link.sync_bandwidth),
        gaps, known.action_s, action,
    )  # fmt: skip


def _read_run(
    folder: Path, trace: str | os.PathLike[str], host_devices: int
) -> tuple[Messages, AllReduces, tuple[float, ...]]:
    """One traced run's timed messages, all-reduces and gaps after actions, refusing a run it cannot
    read honestly."""
    plan = load_plan(folder / "plan.json")
    if plan.virtual_stages > 1:
        raise PipeplanError(
            f"{folder} runs {plan.virtual_stages} stages per rank ({plan.schedule}): its trace names a "
            "rank's spans under one stage, so its messages cannot be told apart; calibrate links from a "
            "run of a plan with one stage per rank"
        )
    if plan.gpus > host_devices:
        raise PipeplanError(
            f"{folder} spans {plan.gpus} devices, more than one host's {host_devices}: hosts' clocks "
            "differ, so a trace cannot time a message between them; calibrate links from a one-host run"
        )
    if not plan.profile:
        raise PipeplanError(f"{folder}/plan.json does not name the profile it was planned from")
    events = read_json(trace, "the trace")
    if not isinstance(events, Mapping) or not isinstance(events.get("traceEvents"), list):
        raise PipeplanError(f"{trace} is not a Chrome trace of a run (pipeplan run --trace FILE)")
    profile = load_profile(plan.profile)  # once: both readings need its stage loads
    messages = waited_messages(events["traceEvents"], message_bytes(plan, profile))
    allreduces = timed_allreduces(events["traceEvents"], _replicated(plan, profile))
    return messages, allreduces, action_gaps(events["traceEvents"])


def _replicated(plan: Plan, profile: Profile) -> list[tuple[int, float]]:
    """Per stage, (replicas, parameter bytes from the plan's profile)."""
    loads = stage_loads(profile, [s.nodes for s in plan.stages])
    return [(s.replicas, float(ld.param_bytes)) for s, ld in zip(plan.stages, loads, strict=True)]


def _allreduce_latency(allreduces: AllReduces, bandwidth: float) -> float | None:
    """``allreduce_time`` solved for its latency per ring step, the median over the all-reduces."""
    if len(allreduces.seconds) < FEWEST:
        return None
    rows = zip(allreduces.seconds, allreduces.nbytes, allreduces.replicas, strict=True)
    excess = [(t - 4.0 * (r - 1) * p / (r * bandwidth)) / (2.0 * (r - 1)) for t, p, r in rows]
    return max(0.0, statistics.median(excess))


def calibrate_with_links(
    folders: Sequence[Path],
    metrics: str | None,
    output: str | None,
    accept_load: bool,
    traces: Sequence[str],
    cluster: str | None,
) -> tuple[Calibration, LinkCalibration | None]:
    """``pipeplan calibrate``: the profile from the runs' stage times and, given traces (the i-th of
    the i-th package's run) and a cluster file (both or neither), the file's latencies from their
    messages and all-reduces. Everything is read and checked before anything is written."""
    if bool(traces) != (cluster is not None):
        raise PipeplanError("--trace and --cluster go together: the run's trace corrects the cluster file")
    if len(traces) > len(folders):
        raise PipeplanError(
            f"{len(traces)} traces for {len(folders)} package{'s' if len(folders) != 1 else ''}: each "
            "--trace is the run of the package in the same place (the first --trace the first package's)"
        )
    runs = list(zip(folders, traces, strict=False))
    links = measure_runs(runs, cluster) if cluster is not None else None
    done = calibrate_package(folders, metrics, output, accept_load)
    if links is not None:
        save_links(links)
    return done, links


def save_links(done: LinkCalibration) -> None:
    """The cluster file with level 0's latency replaced and a record of where it came from."""
    levels = [dict(level) for level in done.doc["levels"]]
    if done.latency_s is not None:
        levels[0]["latency"] = done.latency_s
    if done.allreduce_latency_s is not None:
        levels[0]["allreduce_latency"] = done.allreduce_latency_s
    record = {
        "trace": done.trace,
        "level": 0,
        "latency_before": done.latency_before_s,
        "messages_timed": len(done.messages.seconds),
        "messages_skipped": done.messages.skipped,
        "wire_s_median": done.wire_median_s,
        "wire_s_quartiles": _quartiles(done.messages.seconds),
        "allreduce_latency_before": done.allreduce_latency_before_s,
        "allreduces_timed": len(done.allreduces.seconds),
        "allreduce_s_quartiles": _quartiles(done.allreduces.seconds),
    }
    if done.action_s is not None:
        record |= {
            "action_before": done.action_before_s,
            "actions_timed": len(done.gaps),
            "action_gap_quartiles": _quartiles(done.gaps),
        }
    new = {**done.doc, "levels": levels, "calibrated": record}
    if done.action_s is not None:
        new["action_overhead"] = done.action_s
    write_json_atomic(done.cluster, new)


def _quartiles(values: Sequence[float]) -> list[float]:
    """The lower and upper quartiles; empty for no values (the file stays strict JSON: no NaN)."""
    if len(values) < 2:
        return [values[0], values[0]] if values else []
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]
