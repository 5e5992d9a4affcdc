"""Errors of the runtime a user can act on; ``cli.py`` prints them as one line, exit code 2."""

from __future__ import annotations

__all__ = ["RunError"]


class RunError(Exception):
    """A package, launch or data problem the user can fix (missing files, world size mismatch, ...)."""
