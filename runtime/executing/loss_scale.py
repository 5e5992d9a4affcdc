"""Dynamic loss scaling for fp16 across pipeline stages, with the semantics of ``torch.amp.GradScaler``.

The last stage multiplies its loss by the scale, so every gradient the pipeline computes (the ones sent
between stages included) is scaled and small fp16 gradients do not flush to zero. At each optimizer
step every rank divides its own gradients by the scale and checks them for inf/nan; one all-reduce
over the whole job's process group tells every rank whether any rank found one. If any did, every
stage and every replica skips that step and multiplies the scale by ``backoff_factor``; otherwise they
all step, and after ``growth_interval`` steps in a row without an overflow the scale grows by
``growth_factor``. Every rank starts from the same scale and applies the same updates, so the scale is
the same on all of them without ever being sent.

Why not ``torch.amp.GradScaler`` itself: its overflow flags, which ``step()`` and ``update()`` read,
live in the private ``_per_optimizer_states`` of each scaler. A rank that found no inf has no public way
to learn that another rank did and skip with it (short of writing an inf into one of its own
gradients for its check to find), and ``unscale_()`` refuses to run before ``scale()`` has been called
on that rank, which only the last stage ever does. ``torch.distributed.fsdp.ShardedGradScaler`` does
all-reduce its flags over a process group, but one collective per device its rank holds gradients on,
so it is built for FSDP's uniform ranks, not stages that hold different things. This class is those
thirty lines with the agreement made explicit; its constants and ``state_dict()`` keys are
GradScaler's, so a checkpoint reads like one.

Example:
    >>> scaler = LossScaler(group)  # doctest: +SKIP
    >>> (scaler.scale_loss(loss)).backward()  # last stage  # doctest: +SKIP
    >>> found = scaler.unscale_(grads, comm)  # every rank  # doctest: +SKIP
    >>> if not found.anywhere: optimizer.step()  # doctest: +SKIP
    >>> scaler.update(found.anywhere)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from runtime.executing.comm import Comm

__all__ = ["LossScaler", "Overflow"]


class Overflow(NamedTuple):
    """What one step's check found.

    Attributes:
        here: this rank's own gradients held an inf or nan.
        anywhere: some rank's did (the same on every rank): the step is skipped everywhere.
    """

    here: bool
    anywhere: bool


@dataclass
class LossScaler:
    """The loss scale of a job and how it moves; one per rank, all equal.

    Attributes:
        group: every rank of the job (the overflow check is agreed over it).
        scale: the current factor the last stage multiplies its loss by.
        growth_factor: the scale's factor after ``growth_interval`` steps without an overflow.
        backoff_factor: the scale's factor after a step with one (that step is skipped).
        growth_interval: steps without an overflow before the scale grows.
        growth_tracker: steps without an overflow since the scale last changed.
    """

    group: dist.ProcessGroup
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the last stage runs its backward from."""
        return loss * self.scale

    def unscale_(self, grads: Iterable[torch.Tensor | None], comm: Comm) -> Overflow:
        """Divide this rank's gradients by the scale in place and agree with every rank on an overflow."""
        inverse = 1.0 / self.scale  # the scale is a power of two: exact
        found = torch.zeros(1, dtype=torch.float32, device=comm.device)
        for g in grads:
            if g is not None:
                g.mul_(inverse)
                found += (~torch.isfinite(g)).any()
        here = bool(found.item())
        comm.all_reduce_sum([found], self.group)
        return Overflow(here, bool(found.item()))

    def update(self, overflow: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` clean steps (GradScaler's rule)."""
        if overflow:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys, for a checkpoint."""
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self.growth_tracker,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (or a ``torch.amp.GradScaler``'s)."""
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.growth_tracker = int(state["_growth_tracker"])
