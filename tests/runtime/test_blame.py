"""The one line a failed job ends with names the rank that caused it, not the ranks that lost it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.faults.failed_rank import blame


@dataclass
class _Failure:
    """What the elastic agent records for a rank (the fields blame reads)."""

    exitcode: int
    message: str
    timestamp: int = 0
    error_file: str = ""


STAGE_OF = {0: 0, 1: 1, 2: 1, 3: 2}
LOST = "runtime.errors.PeerLost: receive from rank(s) [{}] failed, another rank is gone or stuck: Timed out"


def test_a_rank_that_raised_beats_the_ranks_that_lost_it() -> None:
    failures = {0: _Failure(1, LOST.format(1), 5), 1: _Failure(1, "ValueError: boom", 6)}
    error = blame(failures, STAGE_OF, 30, Path("run/logs/launcher.log"))
    assert (str(error), error.rank) == (
        "rank 1 (stage 1) failed: ValueError: boom; log: run/logs/launcher.log",
        1,
    )


def test_a_rank_stuck_in_its_data_function_is_named_not_the_rank_that_waited() -> None:
    error = blame({1: _Failure(1, LOST.format(0))}, STAGE_OF, 30)
    assert str(error).startswith("rank 0 (stage 0) stopped responding: rank 1 (stage 1) waited 30 s for it")
    assert error.rank == 0


def test_a_rank_killed_by_a_signal_is_named() -> None:
    error = blame({3: _Failure(-9, "")}, STAGE_OF, 30)
    assert str(error) == "rank 3 (stage 2) failed: the process died (signal 9) without a Python error"


def test_a_lost_peer_that_also_failed_is_not_called_stalled() -> None:
    failures = {0: _Failure(1, LOST.format(1), 5), 1: _Failure(1, LOST.format(0), 5)}
    assert str(blame(failures, STAGE_OF, 30)).startswith("rank 0 (stage 0) failed: runtime.errors.PeerLost")
