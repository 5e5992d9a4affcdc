"""Typed errors a user can act on; ``cli.py`` turns each into one red line and exit code 2."""

from __future__ import annotations

__all__ = [
    "InfeasibleError",
    "ModelSpecError",
    "PackageError",
    "PipeplanError",
    "PlanError",
    "ProfileFormatError",
    "TraceError",
]


class PipeplanError(Exception):
    """Base of every error caused by the user's input rather than by a bug in pipeplan."""


class ModelSpecError(PipeplanError):
    """A model spec that names nothing loadable, or a factory that raised."""


class TraceError(PipeplanError):
    """A model that neither torch.fx nor torch.export could turn into a graph."""


class ProfileFormatError(PipeplanError):
    """A profile file that is missing, corrupt, or of another format or version."""


class PlanError(PipeplanError):
    """A plan request that cannot be met: bad cluster, unknown layers, too many stages."""


class InfeasibleError(PlanError):
    """No plan fits the memory limit; the message names the smallest limit that would."""


class PackageError(PipeplanError):
    """A generated package folder that is incomplete or does not match its model."""
