"""Plans for ``interleaved`` (Megatron's virtual stages): ``gpus * v`` one-device stages, stage ``s``
on rank ``s mod gpus``.

A first version, not an exact search: the cuts come from candidates priced under interleaved's own
cost model (:func:`partitioner.optimizer.cost.interleaved_time`) and the fastest that fits memory
wins. The candidates are the exact straight 1f1b search over ``gpus * v`` devices (balanced stages,
which interleaved also wants: its time is driven by each rank's sum of chunks and the slowest
stage) and torchgpipe's time-balanced split into ``gpus * v`` stages. An exact search would price
the rank sums inside the DP; it does not exist yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile
from partitioner.optimizer.baselines import balanced_cuts
from partitioner.optimizer.build import StageSpec, assemble
from partitioner.plan import Cluster, Plan, SolverInfo
from runtime.schedule import ScheduleError, check_interleaved

__all__ = ["check_virtual", "interleaved_specs", "solve_interleaved"]


def check_virtual(gpus: int, virtual: int, microbatches: int) -> None:
    """What the runtime can play: at least 2 GPUs (a rank does not send to itself) and
    ``microbatches`` a multiple of ``gpus`` when ``virtual`` > 1."""
    if virtual > 1 and gpus < 2:
        raise PlanError("--schedule interleaved with --virtual-stages > 1 needs at least 2 GPUs")
    try:
        check_interleaved(gpus, virtual, microbatches)
    except ScheduleError as exc:
        raise PlanError(str(exc)) from exc


def interleaved_specs(groups: Sequence[Sequence[str]], gpus: int) -> list[StageSpec]:
    """Stage ``s`` (its node ids) on rank ``s mod gpus``, one device each."""
    return [StageSpec(tuple(nodes), 1, (s % gpus,)) for s, nodes in enumerate(groups)]


def _time_balanced(profile: Profile, parts: int) -> list[tuple[str, ...]]:
    """Contiguous slices of the topological order with balanced compute (inputs on the first stage,
    the output marker on the last)."""
    layers = list(profile.layers)
    bounds = balanced_cuts([n.compute_ms for n in layers], parts)
    groups = [tuple(n.id for n in layers[a:b]) for a, b in pairwise(bounds)]
    inputs = tuple(n.id for n in profile.nodes if n.op == "input")
    outputs = tuple(n.id for n in profile.nodes if n.op == "output")
    groups[-1] += outputs
    return [inputs + groups[0], *groups[1:]]


def solve_interleaved(
    profile: Profile,
    cluster: Cluster,
    microbatches: int,
    optimizer: str,
    virtual: int,
    straight: Callable[[Cluster], Plan],
    activation_comm: bool = True,
    recompute: str = "none",
) -> Plan:
    """The fastest interleaved plan among the candidate cuts that fits ``cluster``'s memory.

    ``straight(wide)``: the exact straight 1f1b plan on ``wide`` (``gpus * virtual`` devices).

    Raises:
        PlanError: too few layers for ``gpus * virtual`` stages, or microbatches the order cannot play.
        InfeasibleError: no candidate fits.
    """
    p, parts = cluster.gpus, cluster.gpus * virtual
    check_virtual(p, virtual, microbatches)
    if len(profile.layers) < parts:
        raise PlanError(f"--virtual-stages {virtual} on {p} GPUs needs {parts} stages, the model has "
                        f"{len(profile.layers)} layers")  # fmt: skip
    wide = Cluster.flat(parts, min(lv.bandwidth for lv in cluster.levels))
    candidates = [("time-balanced", _time_balanced(profile, parts))]
    try:
        one = straight(wide)
        if len(one.stages) == parts:
            candidates.insert(0, ("straight 1f1b", [s.nodes for s in one.stages]))
    except InfeasibleError:
        pass
    best: Plan | None = None
    error: InfeasibleError | None = None
    for name, groups in candidates:
        info = SolverInfo(f"interleaved ({name} cuts)", 0.0, False)
        specs = interleaved_specs(groups, p)
        try:
            plan = assemble(profile, cluster, specs, "interleaved", microbatches, optimizer, info,
                            activation_comm=activation_comm, recompute=recompute,
                            virtual=virtual)  # fmt: skip
        except InfeasibleError as exc:
            error = error or exc
            continue
        if best is None or plan.predicted.time_per_minibatch_s < best.predicted.time_per_minibatch_s:
            best = plan
    if best is None:
        raise error or InfeasibleError("no interleaved plan fits")
    return best
