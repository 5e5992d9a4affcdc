"""Start-up check-ins: a wait that times out during start-up names the rank that never came.

During training a rank waits on named peers (a receive from rank 3), so a timeout says whom it waited
for. Start-up waits are collective (joining the process group, creating replica groups, agreeing on
the step to resume from): a rank that is stopped (SIGSTOP, a debugger) or stuck before one of them
leaves every other rank waiting without a name. So each rank records in the job's rendezvous store
how many start-up steps it has completed; when a start-up wait fails, the ranks that completed fewer
steps than this one are the ones it waited for, and :class:`PeerLost` names them (the launcher's
:func:`runtime.faults.failed_rank.blame` then reports that rank, not the one whose wait timed out).

The store is the elastic agent's (``MASTER_ADDR:MASTER_PORT``, shared by the job's ranks); without
one (a rank started by hand) check-ins do nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from runtime.errors import PeerLost
from runtime.faults.liveness import job_store, prefixed

__all__ = ["CheckIn"]


class CheckIn:
    """This rank's start-up progress in the job's store, and who is behind when a wait fails."""

    def __init__(self, rank: int, world: int, store: Any | None) -> None:
        self.rank, self.world, self.store = rank, world, store
        self.completed = -1

    @staticmethod
    def from_env(rank: int, world: int, timeout_s: float) -> CheckIn:
        """A check-in on the elastic agent's store (None outside a launched job)."""
        client = job_store(timeout_s)
        run = os.environ.get("TORCHELASTIC_RUN_ID", "job")
        return CheckIn(rank, world, prefixed(client, f"pipeplan-startup/{run}") if client else None)

    def done(self, step: int) -> None:
        """This rank has completed start-up step ``step`` (0, 1, 2, ... in the same order on every rank)."""
        self.completed = step
        if self.store is not None:
            self.store.set(f"done/{self.rank}", str(step))

    def behind(self) -> list[int]:
        """Ranks that completed fewer start-up steps than this one (never checked in: none)."""
        if self.store is None:
            return []
        late = []
        for rank in range(self.world):
            key = f"done/{rank}"
            try:
                steps = int(self.store.get(key)) if self.store.check([key]) else -1
            except (RuntimeError, ValueError):
                steps = -1
            if steps < self.completed:
                late.append(rank)
        return late

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Re-raise a failed start-up wait as PeerLost naming the ranks that were behind."""
        try:
            yield
        except (RuntimeError, TimeoutError) as exc:
            if isinstance(exc, PeerLost):
                raise
            late = self.behind()
            who = f" for rank(s) {late}" if late else ""
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise PeerLost(f"{what}, waiting{who}, failed, another rank is gone or stuck: {first}") from exc
