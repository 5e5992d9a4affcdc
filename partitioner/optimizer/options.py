"""What a search is asked for, beside the profile and the cluster: one frozen value down the solver's
chain instead of the same parameters at every call."""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.errors import PlanError
from partitioner.graph import Profile
from partitioner.optimizer.pricing.memory import OPTIMIZER_STATE
from partitioner.optimizer.pricing.price import RECOMPUTE_MODES
from partitioner.optimizer.pricing.schedules import MODELS, model

__all__ = [
    "MAX_LAYERS",
    "SOLVERS",
    "SolveOptions",
    "check_devices",
    "check_microbatches",
    "default_microbatches",
]

SOLVERS = ("dp", "ilp")
MAX_LAYERS = 20_000
"""Most layers a profile may have: 20,000 plan in about 10 s and 0.2 GB on a busy 2-core machine,
where 100,000 took 212 s and 3.5 GB (``benchmarks/bench_battery.py`` times the refusal)."""


def check_devices(profile: Profile, devices: int) -> None:
    """Refuse a cluster no plan of ``profile`` can use, before a search sizes arrays by it: every
    device runs a replica of a stage, a stage holds a layer at least and a replica a sample at least.

    Raises:
        PlanError: more devices than layers x samples per minibatch (x 1024 without a batch size).
    """
    samples = profile.batch_size or 1024
    most = max(1, len(profile.layers)) * samples
    if devices > most:
        per = f"a minibatch of {profile.batch_size} samples" if profile.batch_size else "1024 samples"
        raise PlanError(
            f"{devices:,} devices: a plan of {len(profile.layers):,} layers and {per} uses at most "
            f"{most:,} (a replica of one layer per sample); use fewer --gpus or a larger --batch-size"
        )


def check_microbatches(profile: Profile, schedule: str, microbatches: int) -> None:
    """Refuse a plan a run would refuse: a synchronous schedule's microbatches must split the batch.
    (The searches themselves price any count: a cost model answers what-ifs too.)

    Raises:
        PlanError: naming the counts that do split it.
    """
    batch = profile.batch_size
    synchronous = schedule in MODELS and not MODELS[schedule].asynchronous  # (auto: its own counts)
    if batch and synchronous and microbatches >= 1 and batch % microbatches:
        counts = ", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0)
        raise PlanError(
            f"a batch of {batch} does not split into {microbatches} equal microbatches, which a run "
            f"refuses; pick --microbatches among {counts}, or another --batch-size"
        )


def default_microbatches(batch_size: int | None, wanted: int = 4) -> int:
    """The microbatch count a synchronous plan gets when none is asked for: ``wanted``, or the largest
    count below it that splits the batch (a batch of 2 runs as 2 microbatches, not 4 it cannot)."""
    if not batch_size:
        return wanted
    return max(d for d in range(1, min(wanted, batch_size) + 1) if batch_size % d == 0)


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
        if len(profile.layers) > MAX_LAYERS:
            raise PlanError(
                f"the profile has {len(profile.layers):,} layers; the planner takes up to {MAX_LAYERS:,} "
                "(its time and memory grow with the square of the layers): profile with --leaf-module "
                "CLASS so each repeated block is one layer, or merge layers of the graph"
            )
        chosen = [name for name, m in MODELS.items() if m.virtual_stages is None]
        if self.virtual_stages < 1 or (self.virtual_stages > 1 and self.schedule not in chosen):
            raise PlanError(
                f"--virtual-stages {self.virtual_stages} needs --schedule {' or '.join(chosen)} (and >= 1)"
            )
        return self
