"""Which rank ended a failed job, in one line: the rank, its stage, its error and where its log is.

The elastic agent reports the ranks that had exited when it noticed the first failure. A rank that
raised is the cause. A rank that only lost a peer (:class:`PeerLost`) names the peers it waited on;
when none of them raised, the first one named stopped responding (hung, stopped, or stalled in its
data function) and is the one to blame, not the healthy rank whose wait timed out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.errors import JobFailed

__all__ = ["blame", "failure_text"]

_PEERS = re.compile(r"rank\(s\) \[([\d, ]+)\]|rank (\d+)")


def failure_text(failure: Any) -> str:
    """The last line of a rank's Python error, or how its process died."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if failure.exitcode < 0 or not message or "To enable traceback" in str(message):
        how = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        return f"the process died ({how}) without a Python error"
    return str(message).strip().splitlines()[-1]


def _peers(text: str) -> list[int]:
    """Ranks a PeerLost message says it was waiting on, in order."""
    found: list[int] = []
    for group, single in _PEERS.findall(text.split("failed, another rank")[0]):
        found += [int(r) for r in (group or single).replace(" ", "").split(",") if r]
    return found


def _log(failure: Any, fallback: Path | None) -> str:
    """``; log: PATH``: the rank's captured stderr when it wrote any, else the launcher's log (where
    the agent logs a rank's traceback)."""
    error_file = getattr(failure, "error_file", "") or ""
    log = Path(error_file).with_name("stderr.log") if error_file else None
    if log is None or not log.is_file() or not log.stat().st_size:
        log = fallback
    return f"; log: {log}" if log is not None else ""


def blame(
    failures: Mapping[int, Any],
    stage_of: Mapping[int, int],
    timeout_s: float,
    log: Path | None = None,
    silent: Mapping[int, float] | None = None,
) -> JobFailed:
    """The one-line :class:`JobFailed` for a ChildFailedError's ``failures`` (global rank -> failure);
    ``log`` is the launcher's log file, named when a rank left no stderr of its own; ``silent``: the
    ranks the launcher's watchdog ended, silent that many seconds (:mod:`runtime.faults.liveness`)."""

    def where(rank: int) -> str:
        return f"rank {rank} (stage {stage_of[rank]})" if rank in stage_of else f"rank {rank}"

    if silent:
        rank = min(silent)
        return JobFailed(
            f"{where(rank)} stopped responding: no sign of life for {silent[rank]:.0f} s (--timeout "
            f"{timeout_s:g}; stopped, frozen, or stuck where Python cannot run), so the job was ended"
            f"{_log(failures[rank], log) if rank in failures else ''}",
            rank,
        )

    texts = {rank: failure_text(f) for rank, f in failures.items()}
    lost = {rank for rank, text in texts.items() if "PeerLost" in text}
    causes = [r for r in failures if r not in lost]
    if causes:
        rank = min(causes, key=lambda r: (failures[r].exitcode < 0, failures[r].timestamp, r))
        return JobFailed(f"{where(rank)} failed: {texts[rank]}{_log(failures[rank], log)}", rank)
    waiting = min(lost, key=lambda r: (failures[r].timestamp, r))
    stalled = [p for p in _peers(texts[waiting]) if p not in failures]
    if stalled:
        return JobFailed(
            f"{where(stalled[0])} stopped responding: {where(waiting)} waited {timeout_s:g} s for it "
            f"(hung, stopped, or stuck in its data function){_log(failures[waiting], log)}",
            stalled[0],
        )
    return JobFailed(f"{where(waiting)} failed: {texts[waiting]}{_log(failures[waiting], log)}", waiting)
