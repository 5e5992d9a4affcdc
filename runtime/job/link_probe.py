"""``pipeplan probe``: measure a cluster's links on the ranks a run would use, and write a cluster file.

The cost model prices a message as ``latency + bytes / bandwidth`` per level of the cluster
(``partitioner.plan.Link``). This measures both the way nccl-tests and OSU's benchmarks do, with
torch.distributed on the backend a run uses (gloo on CPUs, NCCL on GPUs), started by torch's elastic
launcher like ``pipeplan run`` (local ranks, or every node running the same command):

- per level, between two ranks that talk over it (ranks 0 and 1 within a host; rank 0 and the first
  rank of host 1 across hosts): ping-pong round trips of a small message (the latency: half a round
  trip) and of a large one (the bandwidth: the extra bytes over the extra time, so the latency is
  not counted twice);
- an all-reduce over every rank at a few sizes, with the ranks' cores idle: the runtime sums a
  replicated stage's gradients after the step's last backward, when the rank computes nothing. The
  cost model prices one as a ring, ``4(r-1)P/(rB) + 2(r-1)·latency`` (``allreduce_time``): B from
  the extra time of the largest over the middle size (as a link's bandwidth, so the latency is not
  counted twice), the latency per ring step from the smallest (:func:`fit_allreduce`), written as
  the outermost level's ``allreduce_bandwidth`` and ``allreduce_latency`` (the all-reduce spans
  every rank, so it crosses that level).

Each figure is measured in ``rounds`` rounds of ``messages`` round trips after a warm-up; the file
keeps the median and the rounds' spread ((max - min) / median), which says how steady the link was.
The other ranks wait at a barrier while a pair measures.

On CPU ranks every figure is measured, by default, with each rank's cores busy as a run keeps them: a
thread of each rank multiplies matrices on the run's thread count (``share_cores``) the whole time,
so a message waits for a core the way it does between a pipeline's computations (gloo's threads and
the receiving thread must be scheduled beside the computing ones). What a message costs then depends
on the machine's scheduler and on what else runs, and can differ from the idle figure in either
direction (docs/fidelity.md has measurements). ``idle=True`` measures idle ranks. On CUDA ranks
nothing is loaded: NCCL moves the bytes on its own stream, and a run's computing does not take a CPU
core from it.
Untested on CUDA: the NCCL path follows torch's documented calls (``init_process_group("nccl")``,
``torch.cuda.synchronize``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime.errors import RunError
from runtime.files.atomic import write_json_atomic

__all__ = [
    "CLUSTER_SCHEMA",
    "LinkFigure",
    "ProbeOptions",
    "ProbeOutcome",
    "ProbeResult",
    "fit_allreduce",
    "probe",
    "probe_device",
    "run_probe",
    "write_cluster_file",
]

CLUSTER_SCHEMA = "pipeplan.cluster/1"  # partitioner.hardware.clusters reads it
SMALL_BYTES = 16
LARGE_BYTES = 16 << 20
ALLREDUCE_BYTES = (4096, 1 << 20, 16 << 20)


@dataclass(frozen=True)
class ProbeOptions:
    """What to measure and where.

    Attributes:
        gpus: ranks on this node (GPUs, or CPU processes).
        device: ``cpu`` (gloo) or ``cuda`` (NCCL).
        rounds: repetitions of every figure (the spread is over them).
        messages: round trips (or all-reduces) per round.
        large_bytes: the bandwidth message's size.
        idle: measure CPU ranks idle instead of with their cores busy computing as a run's are.
        nnodes, node_rank, master_addr, master_port, timeout: as ``pipeplan run``'s.
    """

    gpus: int
    device: str = "cpu"
    rounds: int = 5
    messages: int = 20
    large_bytes: int = LARGE_BYTES
    idle: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.gpus * self.nnodes < 2:
            raise RunError("probe needs at least 2 ranks (--gpus 2, or 2 nodes) to measure a link")
        if self.device not in ("cpu", "cuda"):
            raise RunError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.rounds < 1 or self.messages < 1:
            raise RunError("--rounds and --messages must be >= 1")
        if self.large_bytes <= SMALL_BYTES:
            raise RunError(f"the bandwidth message must be larger than {SMALL_BYTES} bytes")

    @property
    def busy(self) -> bool:
        """Whether the ranks compute while measured: CPU ranks, unless ``idle`` (CUDA ranks never)."""
        return self.device == "cpu" and not self.idle


@dataclass(frozen=True)
class LinkFigure:
    """One level's link as measured: medians over the rounds, and each round's figure."""

    level: int
    devices: int
    ranks: tuple[int, int]
    latency_s: float
    bandwidth: float
    latency_rounds_s: tuple[float, ...]
    bandwidth_rounds: tuple[float, ...]

    @property
    def latency_spread(self) -> float:
        return _spread(self.latency_rounds_s)

    @property
    def bandwidth_spread(self) -> float:
        return _spread(self.bandwidth_rounds)


@dataclass(frozen=True)
class ProbeResult:
    """Every level's link, the all-reduces (bytes, median seconds, spread) and the conditions.

    ``cores`` is ``busy`` (each rank computed on ``threads`` threads while measured) or ``idle``;
    ``core_share`` the least share of a core a rank's computing thread got while measured (None when
    idle): well under 1, other processes held the cores too.
    """

    links: tuple[LinkFigure, ...]
    allreduce: tuple[tuple[int, float, float], ...]
    ranks: int
    backend: str
    load: tuple[float, float]
    memory_bytes: int | None
    cores: str = "idle"
    threads: int = 1
    core_share: float | None = None


def _spread(values: Sequence[float]) -> float:
    """(max - min) / median: 0 for a perfectly steady figure."""
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle > 0 else 0.0


def probe(options: ProbeOptions) -> ProbeResult | None:
    """Measure on this node's ranks; rank 0's node returns the result (None on the others).

    Raises:
        RunError: the ranks failed or found no rendezvous (the message names the rank and its error).
    """
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from runtime.job.launch import free_port

    port = options.master_port or (free_port() if options.nnodes == 1 else 29500)
    load_before = os.getloadavg()[0]
    preload = ["torch.distributed", "runtime.job.link_probe", "runtime.job.worker"]
    multiprocessing.set_forkserver_preload(preload)  # one import, forks
    with tempfile.TemporaryDirectory(prefix="pipeplan-probe-") as logs:
        config = LaunchConfig(
            min_nodes=options.nnodes, max_nodes=options.nnodes, nproc_per_node=options.gpus,
            run_id="pipeplan-probe", rdzv_backend="static",
            rdzv_endpoint=f"{options.master_addr}:{port}",
            rdzv_configs={"rank": options.node_rank, "timeout": int(options.timeout)},
            max_restarts=0, monitor_interval=0.1, start_method="forkserver",
            logs_specs=DefaultLogsSpecs(log_dir=logs, redirects=Std.ALL),
        )  # fmt: skip
        try:
            results = elastic_launch(config, _measure)(options)
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()
            raise RunError(f"probe rank {rank} failed: {_failure_line(failure)}") from exc
        except (TimeoutError, RuntimeError) as exc:
            where = f"{options.master_addr}:{port}"
            raise RunError(f"probe: no rendezvous with master {where} within {options.timeout:g}s") from exc
    if options.node_rank != 0:
        return None
    doc = results[0]
    links = tuple(LinkFigure(**{**f, "ranks": tuple(f["ranks"])}) for f in doc["links"])
    allreduce = tuple((int(b), float(t), float(s)) for b, t, s in doc["allreduce"])
    load = (load_before, os.getloadavg()[0])
    shares = [r["core_share"] for r in results.values() if r["core_share"] is not None]
    return ProbeResult(
        links, allreduce, doc["ranks"], doc["backend"], load, doc["memory_bytes"],
        cores="busy" if options.busy else "idle", threads=doc["threads"],
        core_share=min(shares, default=None),
    )  # fmt: skip


def _failure_line(failure: Any) -> str:
    message = failure.message if isinstance(failure.message, str) else json.dumps(failure.message)
    lines = [line for line in str(message).splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {failure.exitcode}"


def _measure(options: ProbeOptions) -> dict[str, Any]:
    """One rank: join the group, measure each level's pair and the all-reduces, leave."""
    import torch
    import torch.distributed as dist

    from runtime.job.worker import share_cores

    cuda = options.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    share_cores()  # the run's thread count: the computing thread's, when busy
    threads = torch.get_num_threads()
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        with _cores_busy(threads, options.busy) as core_share:
            doc = _measure_links(options)
            share = core_share()
        return {**doc, "allreduce": _measure_allreduces(options), "threads": threads, "core_share": share}
    finally:
        dist.destroy_process_group()


def _devices(options: ProbeOptions) -> tuple[Any, Callable[[], None]]:
    """This rank's device and what waits for its work to finish."""
    import torch

    if options.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device()), torch.cuda.synchronize
    return torch.device("cpu"), lambda: None


def _measure_allreduces(options: ProbeOptions) -> list[tuple[int, float, float]]:
    """The all-reduces over every rank, each size's (bytes, median seconds, spread)."""
    device, sync = _devices(options)
    return [_allreduce(size, options, device, sync) for size in ALLREDUCE_BYTES]


def fit_allreduce(allreduce: Sequence[tuple[int, float, float]], ranks: int) -> tuple[float, float] | None:
    """(bandwidth, latency per ring step) of ``4(r-1)P/(rB) + 2(r-1)·latency`` through the measured
    all-reduces (bytes, seconds, spread): B from the extra time of the largest over the one below
    it, the latency from the smallest less its bytes' time (at least 0). None: fewer than 2 ranks
    or 2 sizes, or no extra time for the extra bytes."""
    rows = sorted((b, t) for b, t, _ in allreduce)
    if ranks < 2 or len(rows) < 2:
        return None
    (b1, t1), (b2, t2) = rows[-2], rows[-1]
    if t2 <= t1 or b2 <= b1:
        return None
    steps = ranks - 1
    bandwidth = 4.0 * steps * (b2 - b1) / (ranks * (t2 - t1))
    small, took = rows[0]
    latency = max(0.0, took - 4.0 * steps * small / (ranks * bandwidth)) / (2.0 * steps)
    return bandwidth, latency


def _measure_links(options: ProbeOptions) -> dict[str, Any]:
    """Every level's pair (latency, bandwidth), as this rank sees them."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    device, sync = _devices(options)
    levels = [(options.gpus, (0, 1))] if options.gpus > 1 else []  # within a host
    levels += [(options.nnodes, (0, options.gpus))] if options.nnodes > 1 else []  # across hosts
    links = []
    for level, (devices, pair) in enumerate(levels):
        small = _ping_pong(rank, pair, SMALL_BYTES, options, device, sync)
        large = _ping_pong(rank, pair, options.large_bytes, options, device, sync)
        extra = options.large_bytes - SMALL_BYTES
        rates = [extra / max(b - a, 1e-12) for a, b in zip(small, large, strict=True)]
        links.append({
            "level": level, "devices": devices, "ranks": pair,
            "latency_s": statistics.median(small), "bandwidth": statistics.median(rates),
            "latency_rounds_s": tuple(small), "bandwidth_rounds": tuple(rates),
        })  # fmt: skip
    memory = torch.cuda.get_device_properties(device).total_memory if options.device == "cuda" else None
    return {"links": links, "ranks": world, "backend": dist.get_backend(), "memory_bytes": memory}


@contextmanager
def _cores_busy(threads: int, busy: bool) -> Iterator[Callable[[], float | None]]:
    """While the block runs, a thread multiplies matrices on ``threads`` threads, as a run's rank
    computes between its messages (``busy``; else nothing). Yields a function that gives the share of
    a core the computing thread got so far (its CPU time over the wall time; None when idle): near 1,
    the cores were busy with this rank's work; well under 1, other processes held them too.

    The thread sets its own thread count: OpenMP's is per calling thread, and a new thread would
    otherwise start one per core and oversubscribe them. A product takes about a third of a
    millisecond on one core, so the thread stops soon after the block ends.
    """
    if not busy:
        yield lambda: None
        return
    import torch

    stop = threading.Event()
    computing = [0.0]
    size = 64 * max(4, round(4 * threads ** (1 / 3)))  # 256 on one thread, more work per product on more

    def compute() -> None:
        torch.set_num_threads(threads)
        a, b = torch.randn(size, size), torch.randn(size, size)
        start = time.thread_time()
        while not stop.is_set():
            torch.mm(a, b)
            computing[0] = time.thread_time() - start

    worker = threading.Thread(target=compute, name="probe-busy", daemon=True)
    began = time.perf_counter()
    worker.start()
    try:
        yield lambda: min(1.0, computing[0] / max(time.perf_counter() - began, 1e-9))
    finally:
        stop.set()
        worker.join()


def _rounds(options: ProbeOptions, once: Callable[[], None], sync: Callable[[], None]) -> list[float]:
    """Seconds per call of ``once`` in each of ``options.rounds`` rounds, after a warm-up round."""
    samples = []
    for r in range(options.rounds + 1):
        sync()
        start = time.perf_counter()
        for _ in range(options.messages):
            once()
        sync()
        if r:  # round 0 warms the transport up
            samples.append((time.perf_counter() - start) / options.messages)
    return samples


def _ping_pong(
    rank: int,
    pair: tuple[int, int],
    nbytes: int,
    options: ProbeOptions,
    device: Any,
    sync: Callable[[], None],
) -> list[float]:
    """One-way seconds of an ``nbytes`` message between ``pair``, per round (half a round trip)."""
    import torch
    import torch.distributed as dist

    buffer = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    first, second = pair

    def once() -> None:
        if rank == first:
            dist.send(buffer, second)
            dist.recv(buffer, second)
        elif rank == second:
            dist.recv(buffer, first)
            dist.send(buffer, first)

    samples = _rounds(options, once, sync) if rank in pair else []
    dist.barrier()
    return [t / 2 for t in samples] if rank in pair else [0.0] * options.rounds


def _allreduce(
    nbytes: int, options: ProbeOptions, device: Any, sync: Callable[[], None]
) -> tuple[int, float, float]:
    """(bytes, median seconds of one all-reduce over every rank, spread)."""
    import torch
    import torch.distributed as dist

    buffer = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    samples = _rounds(options, lambda: dist.all_reduce(buffer), sync)
    return nbytes, statistics.median(samples), _spread(samples)


def write_cluster_file(result: ProbeResult, path: Path, command: str) -> dict[str, Any]:
    """The cluster file ``partition --cluster FILE`` reads: the measured levels, and what was measured."""
    levels: list[dict[str, Any]] = [
        {"devices": f.devices, "bandwidth": f.bandwidth, "latency": f.latency_s} for f in result.links
    ]
    fitted = fit_allreduce(result.allreduce, result.ranks)
    if fitted is not None and levels:
        levels[-1].update(allreduce_bandwidth=fitted[0], allreduce_latency=fitted[1])
    doc: dict[str, Any] = {
        "schema": CLUSTER_SCHEMA,
        "name": "probed",
        "description": f"{result.ranks} ranks on {result.backend}, measured by `{command}`",
        "levels": levels,
        "sources": f"`{command}`: ping-pong of {SMALL_BYTES} B (latency) and large messages (bandwidth) "
        f"per level, medians of the rounds, {_conditions(result)}; all-reduces over every rank with "
        "the ranks idle (as after a backward), fitted as a ring; "
        f"load {result.load[0]:.2f} before, {result.load[1]:.2f} after",
        "probe": {
            "cores": result.cores,
            "threads": result.threads,
            "core_share": result.core_share,
            "links": [
                {**asdict(f), "latency_spread": f.latency_spread, "bandwidth_spread": f.bandwidth_spread}
                for f in result.links
            ],
            "allreduce": [{"bytes": b, "seconds": t, "spread": s} for b, t, s in result.allreduce],
            "allreduce_cores": "idle",
            "load_before_after": list(result.load),
        },
    }
    if result.memory_bytes is not None:
        doc["memory"] = str(result.memory_bytes)
    write_json_atomic(path, doc)
    return doc


@dataclass(frozen=True)
class ProbeOutcome:
    """What ``pipeplan probe`` shows: a table (columns, rows) and notes, for the file it wrote."""

    ranks: int
    backend: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...]


def probe_device(choice: str) -> str:
    """``auto`` -> ``cuda`` where torch sees a GPU, else ``cpu``."""
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_probe(options: ProbeOptions, path: Path, command: str) -> ProbeOutcome | None:
    """Measure, write the cluster file (node 0), and say what was measured and how steady it was."""
    result = probe(options)
    if result is None:
        return None
    write_cluster_file(result, path, command)
    columns = ("level", "devices", "latency\nus", "spread", "bandwidth\nGB/s", "spread")
    rows = [
        (str(f.level), str(f.devices), f"{f.latency_s * 1e6:.1f}", f"{f.latency_spread:.0%}",
         f"{f.bandwidth / 1e9:.3f}", f"{f.bandwidth_spread:.0%}")
        for f in result.links
    ]  # fmt: skip
    rows += [
        (_size(b), str(result.ranks), f"{t * 1e6:.1f}", f"{s:.0%}", "", "")
        for b, t, s in result.allreduce
    ]  # fmt: skip
    notes = [
        f"medians of {options.rounds} rounds of {options.messages}, {_conditions(result)}; "
        f"spread = (max - min) / median; "
        f"load {result.load[0]:.2f} before, {result.load[1]:.2f} after ({os.cpu_count()} cores)"
    ]
    fitted = fit_allreduce(result.allreduce, result.ranks)
    if fitted is not None:
        notes.append(
            f"all-reduces measured with the ranks idle (as after a backward) and priced as a ring: "
            f"{fitted[0] / 1e9:.3f} GB/s, {fitted[1] * 1e6:.1f} us a step"
        )
    if result.core_share is not None and result.core_share < 0.5:
        notes.append(
            f"warning: a rank's computing thread got {result.core_share:.0%} of a core: other processes "
            "held the cores too, and the figures measure them; probe again when the machine is quiet"
        )
    per_core = result.load[0] / (os.cpu_count() or 1)
    if per_core > 1.5:
        notes.append(
            f"warning: the machine was loaded ({per_core:.1f} per core): a rank waited for a core between "
            "messages, which a quiet machine does not; probe again when it is quiet"
        )
    steady = max((max(f.latency_spread, f.bandwidth_spread) for f in result.links), default=0.0)
    if steady > 0.25:
        notes.append(
            f"warning: a figure varied by {steady:.0%} between rounds: the machine is busy or the link "
            "shared; probe again when it is quiet, or with more --rounds"
        )
    return ProbeOutcome(result.ranks, result.backend, columns, tuple(rows), tuple(notes))


def _conditions(result: ProbeResult) -> str:
    """How the ranks' cores were held while measured, in words."""
    if result.cores == "idle":
        return "ranks idle" if result.backend == "gloo" else "cores not loaded (NCCL on its own stream)"
    share = f" ({result.core_share:.0%} of a core each)" if result.core_share is not None else ""
    return f"each rank computing on {result.threads} thread(s) as a run's does{share}"


def _size(nbytes: int) -> str:
    """``all-reduce 16 MiB``: a row's name."""
    return f"all-reduce {nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"all-reduce {nbytes / 2**10:g} KiB"
