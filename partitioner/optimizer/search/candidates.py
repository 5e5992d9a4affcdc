"""Plans other tools would choose (data parallel, DeepSpeed's parameter and uniform partitioning,
torchgpipe's time balancing, each with a data-parallel width), priced by our cost model for
comparison (docs/optimizer-search.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from partitioner.errors import InfeasibleError
from partitioner.graph import Profile
from partitioner.optimizer.pricing.price import StageSpec, assemble
from partitioner.optimizer.search.plans import fastest, inputs
from partitioner.plan import Cluster, Plan, SolverInfo

__all__ = ["balanced_cuts", "best_width", "data_parallel", "parameter_balanced", "time_balanced", "uniform"]


def _chain_plan(
    profile: Profile,
    cluster: Cluster,
    bounds: Sequence[int],
    name: str,
    schedule: str,
    m: int,
    optimizer: str,
    width: int = 1,
) -> Plan:
    """Stages between ``bounds``, each on ``width`` consecutive ranks (replicas)."""
    layers = [n.id for n in profile.layers]
    last = len(bounds) - 2
    outputs = tuple(n.id for n in profile.nodes if n.op == "output")  # the loss: the last stage's
    specs = []
    for i in range(len(bounds) - 1):
        nodes = tuple(layers[bounds[i] : bounds[i + 1]]) + (outputs if i == last else ())
        ranks = tuple(range(i * width, (i + 1) * width))
        specs.append(StageSpec(inputs(profile) + nodes if i == 0 else nodes, width, ranks))
    return assemble(profile, cluster, specs, schedule, m, optimizer, SolverInfo(name, 0.0, False))


def balanced_cuts(weights: Sequence[float], parts: int) -> list[int]:
    """Stage bounds over a sequence minimising the heaviest part (binary search on the bound)."""
    w = np.asarray(weights, dtype=np.float64)
    parts = max(1, min(parts, len(w)))
    lo, hi = float(w.max(initial=0.0)), float(w.sum())

    def greedy(limit: float) -> list[int] | None:
        bounds, acc = [0], 0.0
        for i, x in enumerate(w):
            if acc + x > limit and i > bounds[-1]:
                bounds.append(i)
                acc = 0.0
            acc += x
        bounds.append(len(w))
        return bounds if len(bounds) - 1 <= parts else None

    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if greedy(mid) is not None:
            hi = mid
        else:
            lo = mid
    bounds = greedy(hi) or [0, len(w)]
    while len(bounds) - 1 < parts:  # use every device: split the largest stage that can be split
        sizes = [(bounds[i + 1] - bounds[i], i) for i in range(len(bounds) - 1)]
        size, i = max(sizes)
        if size < 2:
            break
        bounds.insert(i + 1, bounds[i] + size // 2)
    return bounds


def parameter_balanced(
    profile: Profile, cluster: Cluster, schedule: str, m: int, optimizer: str, width: int = 1
) -> Plan:
    """DeepSpeed's parameter balancing: ``gpus // width`` stages of ``width`` GPUs, parameters split
    evenly."""
    bounds = balanced_cuts([float(n.param_bytes) for n in profile.layers], cluster.gpus // width)
    return _chain_plan(profile, cluster, bounds, "parameters", schedule, m, optimizer, width)


def time_balanced(
    profile: Profile, cluster: Cluster, schedule: str, m: int, optimizer: str, width: int = 1
) -> Plan:
    """torchgpipe's balance_by_time: ``gpus // width`` stages of ``width`` GPUs, measured compute
    split evenly."""
    bounds = balanced_cuts([n.compute_ms for n in profile.layers], cluster.gpus // width)
    return _chain_plan(profile, cluster, bounds, "time", schedule, m, optimizer, width)


def uniform(
    profile: Profile, cluster: Cluster, schedule: str, m: int, optimizer: str, width: int = 1
) -> Plan:
    """DeepSpeed's uniform method: the same number of layers per stage, ``width`` GPUs each."""
    n = len(profile.layers)
    parts = min(cluster.gpus // width, n)
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return _chain_plan(profile, cluster, bounds, "uniform", schedule, m, optimizer, width)


def best_width(at: Callable[[int], Plan], gpus: int) -> Plan:
    """The fastest plan ``at(width)`` gives that fits, over the data-parallel widths dividing ``gpus``
    (1 included): the hybrid a user of a balancing method would run.

    Raises:
        InfeasibleError: no width fits in memory.
    """
    best = fastest(partial(at, w) for w in range(1, gpus + 1) if gpus % w == 0)
    if best is None:
        raise InfeasibleError("no data-parallel width fits in memory")
    return best


def data_parallel(profile: Profile, cluster: Cluster, schedule: str, m: int, optimizer: str) -> Plan:
    """One stage replicated on every GPU."""
    nodes = tuple(n.id for n in profile.nodes)
    spec = StageSpec(nodes, cluster.gpus, tuple(range(cluster.gpus)))
    return assemble(profile, cluster, [spec], schedule, m, optimizer, SolverInfo("data-parallel", 0.0, False))
