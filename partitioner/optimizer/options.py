"""What a search is asked for, beside the profile and the cluster.

One frozen value travels down the solver's chain of functions (solve, the kept and recomputing
searches, the pipedream and synchronous searches, the memory bisection) instead of the same seven
parameters at every call, so adding an option touches the places that read it and no others.
"""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.errors import PlanError
from partitioner.graph import Profile
from partitioner.optimizer.pricing.memory import OPTIMIZER_STATE
from partitioner.optimizer.pricing.price import RECOMPUTE_MODES
from partitioner.optimizer.pricing.schedules import MODELS, model

__all__ = ["SOLVERS", "SolveOptions"]

SOLVERS = ("dp", "ilp")


@dataclass(frozen=True)
class SolveOptions:
    """The plan's schedule and training settings, and how to search.

    Attributes:
        schedule: a key of ``pricing.schedules.MODELS``.
        microbatches: per minibatch, for the synchronous schedules (pipedream runs whole minibatches).
        optimizer: sgd, momentum, adam or adamw (its state counts in memory).
        straight: one device per stage (no replication).
        solver: ``dp`` (exact searches) or ``ilp`` (pulp, small profiles).
        activation_comm: charge 2·activation/(B·r) per cut; PipeDream's optimizer charges none by
            default (only with a compression ratio).
        recompute: ``none``, ``all`` or ``auto`` (``price.RECOMPUTE_MODES``).
        virtual_stages: stages per device where the schedule lets the user choose them
            (``interleaved``: Megatron's virtual stages); 1 elsewhere.
    """

    schedule: str = "pipedream"
    microbatches: int = 1
    optimizer: str = "sgd"
    straight: bool = False
    solver: str = "dp"
    activation_comm: bool = True
    recompute: str = "none"
    virtual_stages: int = 1

    @property
    def m(self) -> int:
        """Microbatches the cost model prices: 1 for a schedule of whole minibatches (pipedream)."""
        return model(self.schedule).microbatches(self.microbatches)

    def checked(self, profile: Profile) -> SolveOptions:
        """These options, once every value is known good for ``profile``.

        Raises:
            PlanError: an unknown schedule, optimizer, solver or recompute mode, fewer than one
                microbatch, or a profile without layers.
        """
        model(self.schedule)  # (an unknown one: a PlanError naming the known ones)
        if self.optimizer not in OPTIMIZER_STATE:
            raise PlanError(f"unknown optimizer {self.optimizer!r}; use sgd, momentum, adam or adamw")
        if self.microbatches < 1:
            raise PlanError(f"--microbatches must be >= 1, got {self.microbatches}")
        if self.solver not in SOLVERS:
            raise PlanError(f"unknown solver {self.solver!r}; use dp or ilp")
        if self.recompute not in RECOMPUTE_MODES:
            raise PlanError(f"unknown recompute mode {self.recompute!r}; use {', '.join(RECOMPUTE_MODES)}")
        if not profile.layers:
            raise PlanError("the profile has no layers to partition")
        chosen = [name for name, m in MODELS.items() if m.virtual_stages is None]
        if self.virtual_stages < 1 or (self.virtual_stages > 1 and self.schedule not in chosen):
            raise PlanError(
                f"--virtual-stages {self.virtual_stages} needs --schedule {' or '.join(chosen)} (and >= 1)"
            )
        return self
