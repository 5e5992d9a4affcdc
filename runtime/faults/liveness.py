"""A stopped rank ends the job within ``--timeout`` of stopping, in every phase, and is the one blamed.

Each rank beats once a second into the job's rendezvous store (a daemon thread: it beats while the
rank computes, loads data, writes checkpoints or waits on a peer). A stopped process (SIGSTOP, a
debugger, a machine that froze it) stops beating with all its threads. The launcher of each node
watches its own ranks' beats; a rank silent for ``--timeout`` seconds is killed (SIGKILL works on a
stopped process), so the elastic agent stops the job at once, and :func:`runtime.faults.failed_rank.blame` is
told that this rank stopped responding. Without the watch, the job would end only once a peer's wait on it
timed out, which starts whenever that peer gets there (under load, many seconds after the stop) and
blames the waiting peer when the wait is collective.

A rank that hangs while its threads still run (an endless loop in a data function) keeps beating;
its peers' waits time out and name it (:class:`runtime.errors.PeerLost`,
:mod:`runtime.faults.startup_checkin`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

__all__ = ["BEAT_S", "Watchdog", "job_store", "prefixed", "start_heartbeat"]

BEAT_S = 1.0
"""Seconds between a rank's beats."""


def job_store(timeout_s: float) -> Any | None:
    """In a rank, a client of the job's store (the elastic agent's, at ``MASTER_ADDR:MASTER_PORT``);
    None outside a launched job."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        return None
    import torch.distributed as dist

    try:
        return dist.TCPStore(  # type: ignore[attr-defined]
            addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s)
        )
    except (RuntimeError, ValueError):
        return None


def prefixed(store: Any, prefix: str) -> Any:
    """``store`` with every key under ``prefix/``."""
    import torch.distributed as dist

    return dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]


def start_heartbeat(rank: int, timeout_s: float) -> bool:
    """Beat for this rank from a daemon thread on its own store connection; False without a store."""
    client = job_store(timeout_s)
    if client is None:
        return False
    store = prefixed(client, f"pipeplan-beat/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}")
    pid = os.getpid()

    def beat() -> None:
        count = 0
        while True:
            try:
                store.set(f"rank/{rank}", f"{pid} {count}")
            except RuntimeError:  # the launcher (and its store) is gone: the lifeline ends this rank
                return
            count += 1
            time.sleep(BEAT_S)

    threading.Thread(target=beat, daemon=True, name="pipeplan-heartbeat").start()
    return True


class Watchdog:
    """The launcher's watch over its node's ranks: kill one whose beats stopped for ``timeout_s``.

    Attributes:
        stalled: the ranks it killed, with the seconds each had been silent.
    """

    def __init__(self, store: Any, run_id: str, ranks: Iterable[int], timeout_s: float) -> None:
        """``store`` None (another node's launcher that cannot reach node 0's yet): watch nothing; the
        rendezvous then says what is wrong."""
        self.store: Any = prefixed(store, f"pipeplan-beat/{run_id}") if store is not None else None
        self.ranks = tuple(ranks) if store is not None else ()
        self.timeout_s = timeout_s
        self.stalled: dict[int, float] = {}
        self._stop = threading.Event()
        self._seen: dict[int, tuple[str, float]] = {}
        self._thread = threading.Thread(target=self._watch, daemon=True, name="pipeplan-watchdog")

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(BEAT_S / 2):
            now = time.monotonic()
            for rank in self.ranks:
                if rank in self.stalled:
                    continue
                beat = self._read(rank)
                if beat is None:
                    continue  # not started yet: a start-up wait names it (runtime.faults.startup_checkin)
                last = self._seen.get(rank)
                if last is None or last[0] != beat:
                    self._seen[rank] = (beat, now)
                elif now - last[1] > self.timeout_s:
                    self._kill(rank, beat, now - last[1])

    def _read(self, rank: int) -> str | None:
        key = f"rank/{rank}"
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except RuntimeError:
            return None

    def _kill(self, rank: int, beat: str, silent_s: float) -> None:
        self.stalled[rank] = silent_s
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(beat.split()[0]), signal.SIGKILL)
