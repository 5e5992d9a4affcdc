"""PipeDream's objective on one level, solved by its plain recurrence (``compute_partitioning``): the
yardstick the fast paths are tested against, nothing else (docs/optimizer-search.md)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partitioner.errors import InfeasibleError
from partitioner.optimizer.pricing.stage import FloatArray, IntArray, stage_time
from partitioner.optimizer.search.states import StateSet
from partitioner.plan import Link

__all__ = ["ReferencePlan", "count_plans", "solve_reference", "stage_times"]


@dataclass(frozen=True)
class ReferencePlan:
    """The optimum and one plan attaining it: stages as (start state, end state, replicas)."""

    time_s: float
    stages: tuple[tuple[int, int, int], ...]


def stage_times(
    states: StateSet, ks: IntArray, j: int, r: int, link: Link, first_output: bool = True
) -> FloatArray:
    """T(k, j, r) for every k in ``ks``: the stage (k, j] on r replicas, its cut traffic included."""
    c, p, act = states.compute_s, states.param_bytes, states.act_bytes
    out = np.full(len(ks), act[j])
    if not first_output:
        out[ks == 0] = 0.0
    return stage_time(c[j] - c[ks] + states.stage_s, p[j] - p[ks], r, link, act=np.maximum(act[ks], out))


def solve_reference(
    states: StateSet, gpus: int, link: Link, max_replicas: int | None = None, first_output: bool = True
) -> ReferencePlan:
    """PipeDream's recurrence (docs/optimizer-search.md), filled state by state.

    Raises:
        InfeasibleError: ``gpus`` < 1 (no plan at all).
    """
    n, cap = len(states), min(gpus, max_replicas or gpus)
    best = np.full((n, gpus + 1), np.inf)
    best[0, :] = 0.0
    arg = np.zeros((n, gpus + 1, 2), dtype=np.int64)  # (k, r) attaining best[j, u]
    for j in range(1, n):
        ks = states.pred(j)
        for r in range(1, cap + 1):
            stage = stage_times(states, ks, j, r, link, first_output)
            t = np.maximum(best[ks, : gpus + 1 - r], stage[:, None])  # column u - r, for u = r..gpus
            i = np.argmin(t, axis=0)
            value = t[i, np.arange(t.shape[1])]
            better = value < best[j, r:]
            best[j, r:][better] = value[better]
            arg[j, r:][better] = np.stack([ks[i[better]], np.full(int(better.sum()), r)], axis=1)
    if not np.isfinite(best[n - 1, gpus]):
        raise InfeasibleError(f"no plan on {gpus} devices")
    stages, j, u = [], n - 1, gpus
    while j > 0:
        k, r = (int(x) for x in arg[j, u])
        stages.append((k, j, r))
        j, u = k, u - r
    return ReferencePlan(float(best[n - 1, gpus]), tuple(reversed(stages)))


def count_plans(
    states: StateSet, gpus: int, link: Link, time_s: float, max_replicas: int | None = None,
    first_output: bool = True,
) -> float:  # fmt: skip
    """How many plans (cuts and replicas, idle devices not told apart) take at most ``time_s``:
    1 at the optimum means the optimal plan is unique. Same recurrence, counting instead of
    minimising (a float: the counts of a bottleneck objective's ties grow fast)."""
    n, cap = len(states), min(gpus, max_replicas or gpus)
    count = np.zeros((n, gpus + 1))
    count[0, :] = 1.0
    for j in range(1, n):
        ks = states.pred(j)
        for r in range(1, cap + 1):
            fast = ks[stage_times(states, ks, j, r, link, first_output) <= time_s]
            count[j, r:] += count[fast][:, : gpus + 1 - r].sum(axis=0)
    return float(count[n - 1, gpus])
