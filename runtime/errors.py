"""Errors of the runtime a user can act on; ``cli.py`` prints them as one line, exit code 2."""

from __future__ import annotations

__all__ = ["Interrupted", "JobFailed", "PeerLost", "RunError"]


class RunError(Exception):
    """A package, launch or data problem the user can fix (missing files, world size mismatch, ...)."""


class JobFailed(Exception):
    """A rank raised or died during training; the message names the rank and its error.

    Attributes:
        rank: the global rank that failed first (None when unknown).
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class PeerLost(RuntimeError):
    """A send, receive or all-reduce failed because another rank died, hung or closed its connection.

    Usually a consequence, not a cause: the launcher reports the rank that failed for another reason
    when there is one.
    """


class Interrupted(Exception):
    """The launcher got SIGTERM, SIGINT or SIGHUP; every rank was stopped with the same signal.

    Attributes:
        signum: the signal's number (the command exits with 128 + signum, as a shell does).
    """

    def __init__(self, signum: int) -> None:
        import signal

        super().__init__(f"stopped by {signal.Signals(signum).name}; every rank was stopped with it")
        self.signum = signum
