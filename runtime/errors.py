"""Errors of the runtime a user can act on; ``cli.py`` prints them as one line, exit code 2."""

from __future__ import annotations

__all__ = ["JobFailed", "PeerLost", "RunError"]


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
