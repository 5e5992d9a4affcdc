"""Start a package's ranks with PyTorch's own launcher (the elastic agent behind torchrun).

Locally every rank starts on this machine; with ``nnodes > 1`` each node runs the same command with its
``node_rank``, as with torchrun (static rendezvous at ``master_addr:master_port``). ``max_restarts=0``:
when a rank raises or dies the agent stops the others, and :class:`JobFailed` names the rank and its
error. :func:`torchrun_commands` prints the equivalent per-node torchrun lines for ``--dry-run``.
"""

from __future__ import annotations

import inspect
import json
import logging
import multiprocessing
import os
import shlex
import shutil
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from runtime.checkpoints import step_folders as checkpoint
from runtime.checkpoints.resume_settings import resume_lines
from runtime.datasets.minibatches import check_data_options
from runtime.errors import Interrupted, RunError
from runtime.faults.failed_rank import blame
from runtime.faults.liveness import Watchdog
from runtime.job.preflight import disk_full, preflight
from runtime.job.run_folders import begin, package_lock, publish
from runtime.job.worker import job_of, run_dir, run_rank
from runtime.settings.run_options import RunOptions, to_argv
from runtime.settings.run_toml import write_config

__all__ = [
    "call_ranks",
    "check_launch",
    "free_port",
    "holding_run_folder",
    "launch",
    "resolve_resume",
    "schedule_preview",
    "torchrun_commands",
]


class Progress(Protocol):
    """Told each step's loss, and after an evaluation its entry (``step``, ``loss``, ``accuracy``)."""

    def __call__(self, step: int, loss: float, evaluation: dict[str, Any] | None = None) -> None: ...


log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_launch(options: RunOptions) -> int:
    """Validate the package, data, output paths and node options before anything starts (see
    :mod:`runtime.job.preflight`); returns ranks per node."""
    check_data_options(options)
    job = job_of(options)
    if not (job.package / "__init__.py").is_file():
        raise RunError(
            f"{job.package} holds a plan but no stage code (plans made from a PipeDream graph.txt have no "
            "model to run); partition a profile made by `pipeplan profile MODEL`"
        )
    world = job.world_size
    if options.nnodes < 1 or world % options.nnodes:
        raise RunError(f"the package needs {world} ranks, which {options.nnodes} nodes cannot share evenly")
    if not 0 <= options.node_rank < options.nnodes:
        raise RunError(f"--node-rank must be in 0..{options.nnodes - 1}, got {options.node_rank}")
    if options.nnodes > 1 and not options.master_port:
        raise RunError("a multi-node job needs --master-addr and --master-port (the same on every node)")
    if job.virtual_stages > 1 and world > 1 and options.backend == "nccl":
        raise RunError(f"--schedule {job.schedule} runs on gloo only for now (NCCL ignores message tags)")
    local, gpus = world // options.nnodes, _cuda_count()
    if options.backend == "nccl" and gpus < local:
        raise RunError(
            f"--backend nccl runs each of this node's {local} ranks on a CUDA GPU, and torch here sees "
            f"{gpus}; use --backend gloo (or auto), or a machine with the GPUs"
        )
    preflight(options, job, run_dir(options))
    return world // options.nnodes


def _cuda_count() -> int:
    """CUDA devices torch sees on this node."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_resume(options: RunOptions) -> tuple[RunOptions, list[str]]:
    """With ``--resume``: the options with the step to continue after, and one line per thing the user
    should hear (the step, or that there is none; steps skipped as torn or unreadable; another plan;
    accepted changes).

    Raises:
        RunError: a checkpoint of another model or format, or a resume that would change the run
            without ``--accept-changes`` (:mod:`runtime.checkpoints.resume_settings`).
    """
    if not options.resume or not options.checkpoint_dir or options.resume_step is not None:
        return options, []
    job = job_of(options)
    root = Path(options.checkpoint_dir)
    point = checkpoint.resume_point(root)
    notes = [f"skipped {root}/{line}" for line in point.skipped]
    if point.removed:
        notes.append(f"removed {point.removed} leftover(s) of an interrupted checkpoint write in {root}")
    if point.step is None:
        notes.append(f"no usable checkpoint in {root}: starting from step 0")
        return replace(options, resume_step=0), notes
    notes += resume_lines(options, job, point.step)
    notes.append(f"resuming after step {point.step} from {checkpoint.step_dir(root, point.step)}")
    return replace(options, resume_step=point.step), notes


def torchrun_commands(options: RunOptions) -> list[str]:
    """The torchrun line each node would run, node 0 first."""
    per_node = check_launch(options)
    port = options.master_port or 29500
    args = shlex.join(to_argv(options))
    return [
        f"torchrun --nnodes {options.nnodes} --node-rank {node} --nproc-per-node {per_node} "
        f"--master-addr {options.master_addr} --master-port {port} --max-restarts 0 -m runtime.job.worker "
        f"{args}"
        for node in range(options.nnodes)
    ]


def schedule_preview(options: RunOptions) -> list[str]:
    """One minibatch of every rank's action list in text form (``0F0 0F1 0B0 ...``), for --dry-run."""
    from runtime.schedule import build, format_actions

    job = job_of(options)
    lines = []
    lists = build(job.schedule, job.copy_layout, job.microbatches)  # one per copy (3D: of t ranks)
    for r in range(job.world_size):
        actions, stages = lists[job.copy_rank(r)], job.hosted_stages(r)
        what = f"stages {','.join(map(str, stages))}" if len(stages) > 1 else f"stage {stages[0]}"
        lines.append(f"rank {r} ({what}): {format_actions(actions)}")
    return lines


def _raise_if_full(out: Path, options: RunOptions) -> None:
    """A full disk under the run folder or the checkpoints is the cause of a failure: say so, once."""
    folders = [out, *([Path(options.checkpoint_dir)] if options.checkpoint_dir else [])]
    for folder in folders:
        full = disk_full(folder)
        if full:
            last = checkpoint.last_complete(Path(options.checkpoint_dir)) if options.checkpoint_dir else None
            need, where = "", "the last complete checkpoint"
            if last is not None:
                need = f"; a checkpoint step needs about {last[1]:,} bytes (step-{last[0]} took that)"
                where = f"step-{last[0]}, the last complete checkpoint"
            raise RunError(
                f"training stopped: {full}{need}; free space (or give --checkpoint-dir elsewhere), then "
                f"`pipeplan run --resume` continues from {where}"
            )


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _forward(path: Path, on_progress: Progress, seen: int) -> int:
    """Hand every new complete progress line to ``on_progress``; returns how many were handled."""
    if not path.exists():
        return seen
    for line in path.read_text(encoding="utf-8").splitlines()[seen:]:
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            break
        on_progress(int(doc["step"]), float(doc["loss"]), doc.get("eval"))
        seen += 1
    return seen


def _watch(path: Path, on_progress: Progress, stop: threading.Event) -> None:
    """Forward progress lines written by the loss-reporting rank until the job ends."""
    seen = 0
    while True:
        finished = stop.wait(0.2)
        seen = _forward(path, on_progress, seen)
        if finished:
            return


def _config(options: RunOptions, per_node: int, logs: Path) -> Any:
    """torchrun's static rendezvous at the master, no restarts, a fast failure monitor; each rank's
    stdout and stderr go to ``logs/<run id>/attempt_0/<rank>/``, not to the user's terminal."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    if options.start_method == "forkserver":
        # The fork server imports torch and the runtime once; every rank forks from that single-threaded
        # process. Forking the launcher itself is faster but can deadlock a rank: the launcher runs the
        # rendezvous store's threads, and a lock one of them holds at fork time stays locked in the child.
        multiprocessing.set_forkserver_preload(["runtime.job.worker"])
    # shutdown_timeout (torch >= 2.12) bounds the wait for ranks to exit after a failure; older
    # torch has no such field and keeps its own default.
    extra: dict[str, Any] = (
        {"shutdown_timeout": 5} if "shutdown_timeout" in inspect.signature(LaunchConfig).parameters else {}
    )
    return LaunchConfig(
        min_nodes=options.nnodes,
        max_nodes=options.nnodes,
        nproc_per_node=per_node,
        run_id=f"pipeplan-{uuid.uuid4().hex[:8]}" if options.nnodes == 1 else "pipeplan",
        rdzv_backend="static",
        rdzv_endpoint=f"{options.master_addr}:{options.master_port}",
        rdzv_configs={"rank": options.node_rank, "timeout": int(options.timeout)},
        max_restarts=0,
        monitor_interval=0.1,
        start_method=options.start_method,
        logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ALL),
        **extra,
    )


class _QuietFileHandler(logging.FileHandler):
    """A log file that drops what it cannot write (a full disk) instead of printing a traceback per
    record; the job's own error says what happened."""

    def handleError(self, record: logging.LogRecord) -> None:
        return None


@contextmanager
def _agent_log(path: Path) -> Iterator[None]:
    """Send the elastic agent's own log (worker start/stop, its tracebacks) to ``path``, not stderr."""
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
    handler = _QuietFileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = [(logger, logger.propagate, logger.level, logger.handlers[:]) for logger in loggers]
    for logger in loggers:
        logger.handlers = [handler]
        logger.propagate = False
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        handler.close()
        for logger, propagate, level, handlers in saved:
            logger.handlers, logger.propagate, logger.level = handlers, propagate, level


def holding_run_folder(options: RunOptions) -> AbstractContextManager[None]:
    """The package's run lock (:func:`runtime.job.run_folders.package_lock`), to hold across
    :func:`runtime.job.run_folders.begin`, :func:`check_launch` and :func:`launch` (which takes it too: one
    job per package folder at a time)."""
    return package_lock(options)


def launch(
    options: RunOptions, on_progress: Progress | None = None, checked: int | None = None
) -> dict[str, Any] | None:
    """Run this node's ranks to completion; returns rank 0's metrics (None on other nodes).

    ``checked``: what :func:`check_launch` returned when the caller already ran it (it imports the
    package and draws a minibatch, so it runs once).

    Raises:
        RunError: bad package or options, or no rendezvous with the master within the timeout.
        JobFailed: a rank raised or died.
    """
    if options.run_dir is None:  # a library caller: a run folder of its own, as `pipeplan run` makes
        with package_lock(options):
            options = begin(options, checkpoints=False)
    per_node = checked if checked is not None else check_launch(options)
    options, notes = resolve_resume(options)
    for note in notes:
        log.info("%s", note)
    write_config(run_dir(options), replace(options, resume_step=None))
    publish(options)
    with _rendezvous_store(options) as (port, store):
        options = replace(options, master_port=port, launcher_pid=os.getpid())
        return _launch(options, per_node, on_progress, store)


@contextmanager
def _rendezvous_store(options: RunOptions) -> Iterator[tuple[int, Any]]:
    """On node 0, the rendezvous store's server, listening on ``master_addr`` only (127.0.0.1 for a
    local run) rather than every interface, as torch's static rendezvous would bind it; the rendezvous
    then shares this server (``multi_tenant``). Yields the port (a free one when none was given) and
    the store (on other nodes a client of node 0's, or None when it does not answer yet).

    Raises:
        RunError: the address or port cannot be listened on.
    """
    import torch.distributed as dist

    if options.node_rank != 0:
        try:
            client = dist.TCPStore(  # type: ignore[attr-defined]
                options.master_addr, options.master_port, is_master=False,
                timeout=timedelta(seconds=options.timeout),
            )  # fmt: skip
        except (RuntimeError, ValueError):
            client = None  # the rendezvous below says what is wrong
        yield options.master_port, client
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            options.master_addr, options.master_port, type=socket.SOCK_STREAM
        )[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(1024)
    except OSError as exc:
        where = f"{options.master_addr}:{options.master_port}"
        raise RunError(f"cannot listen on {where} for the rendezvous: {exc.strerror or exc}") from exc
    port = int(listener.getsockname()[1])
    store = dist.TCPStore(  # type: ignore[attr-defined]
        options.master_addr, port, is_master=True, multi_tenant=True, master_listen_fd=listener.detach(),
        timeout=timedelta(seconds=options.timeout), wait_for_workers=False,
    )  # fmt: skip
    try:
        yield port, store
    finally:
        del store


def _launch(
    options: RunOptions, per_node: int, on_progress: Progress | None, store: Any
) -> dict[str, Any] | None:
    """:func:`launch` once the rendezvous store listens: the run folder locked, a :class:`Watchdog`
    over this node's ranks, a full disk named as the cause of whatever it broke."""
    with package_lock(options):
        return _launch_locked(options, per_node, on_progress, store)


def _launch_locked(
    options: RunOptions, per_node: int, on_progress: Progress | None, store: Any
) -> dict[str, Any] | None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    out = run_dir(options)
    (out / "progress.jsonl").unlink(missing_ok=True)
    # nodes sharing the package folder (one machine, or a network file system) keep their own logs
    logs = out / "logs" if options.nnodes == 1 else out / "logs" / f"node{options.node_rank}"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True, exist_ok=True)
    config = _config(options, per_node, logs)
    stop = threading.Event()
    watcher = None
    if on_progress is not None:
        watcher = threading.Thread(
            target=_watch, args=(out / "progress.jsonl", on_progress, stop), daemon=True
        )
        watcher.start()
    local = range(options.node_rank * per_node, (options.node_rank + 1) * per_node)
    watchdog = Watchdog(store, config.run_id, local, options.timeout)
    try:
        with _agent_log(logs / "launcher.log"), watchdog:
            results = elastic_launch(config, run_rank)(options)
    except ChildFailedError as exc:
        _raise_if_full(out, options)
        job = job_of(options)
        stage_of = {r: k for k, ranks in enumerate(job.stage_ranks) for r in ranks}
        failures = exc.failures
        raise blame(failures, stage_of, options.timeout, logs / "launcher.log", watchdog.stalled) from exc
    except (OSError, ValueError) as exc:  # the agent could not write or read its own files (a rank's
        _raise_if_full(out, options)  # error file, left empty on a full disk)
        raise RunError(f"the launcher failed: {_first_line(exc)}; its log: {logs / 'launcher.log'}") from exc
    except SignalException as exc:
        raise Interrupted(int(exc.sigval)) from exc
    except (TimeoutError, RuntimeError) as exc:
        where = f"{options.master_addr}:{options.master_port}"
        raise RunError(
            f"no rendezvous with master {where} within {options.timeout:g}s: {_first_line(exc)}"
        ) from exc
    finally:
        stop.set()
        if watcher is not None:
            watcher.join()
    return results.get(0) if options.node_rank == 0 else None


def call_ranks(options: RunOptions, entry: Callable[..., Any], *args: Any, logs: Path) -> dict[int, Any]:
    """``entry(*args)`` on every rank of ``options.package``, on this machine, started as
    :func:`launch` starts a job (the elastic agent, static rendezvous on a store of our own, no
    restarts, each rank's output under ``logs``); returns each rank's return value by rank. For
    checks that run a package's ranks without training it (``pipeplan verify`` of a 3D package).

    Raises:
        JobFailed: a rank raised or died, in one line naming it, its stage and its log.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    job = job_of(options)
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True, exist_ok=True)
    stage_of = {r: k for k, ranks in enumerate(job.stage_ranks) for r in ranks}
    with _rendezvous_store(replace(options, nnodes=1, node_rank=0)) as (port, _):
        options = replace(options, master_port=port, launcher_pid=os.getpid())
        config = _config(options, job.world_size, logs)
        try:
            with _agent_log(logs / "launcher.log"):
                return dict(elastic_launch(config, entry)(*args))
        except ChildFailedError as exc:
            raise blame(exc.failures, stage_of, options.timeout, logs / "launcher.log") from exc
