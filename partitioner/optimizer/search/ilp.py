"""The same stage + replication problem as a MILP in pulp, to cross-check the DP on small cases
(docs/optimizer-search.md). The only module that imports pulp, and only when a MILP is solved."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile
from partitioner.optimizer.pricing.memory import MemoryLimit
from partitioner.optimizer.pricing.price import StageSpec, assemble, global_lower_bound
from partitioner.optimizer.pricing.schedules import model as schedule_model
from partitioner.optimizer.pricing.stage import allreduce_time, microbatch_time
from partitioner.optimizer.search.dp import LevelProblem
from partitioner.optimizer.search.states import StateSet, build_states
from partitioner.plan import Cluster, Link, Plan, SolverInfo

if TYPE_CHECKING:
    import pulp

__all__ = ["MAX_ILP_VARIABLES", "solve_ilp"]

MAX_ILP_VARIABLES = 200_000


def _backend() -> pulp.LpSolver:
    """HiGHS where highspy is installed (``.[highs]``, ``.[dev]``), else a CBC on the PATH (COIN_CMD:
    ``pip install pulp[cbc]``), PuLP 3's current solvers; else the CBC binary PuLP still bundles,
    which it deprecates for 4.0 (its warning is kept out of the user's output: it asks nothing of them)."""
    import warnings

    import pulp

    try:
        import highspy  # noqa: F401

        return pulp.HiGHS(msg=False)
    except ImportError:
        pass
    coin = pulp.COIN_CMD(msg=False)
    if coin.available():
        return coin
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False)


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """File descriptor 1 sent to /dev/null for the block: a solver's C++ code writes to it directly."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def solve_ilp(
    profile: Profile,
    cluster: Cluster,
    schedule: str,
    microbatches: int,
    optimizer: str,
    straight: bool,
    activation_comm: bool = True,
) -> Plan:
    """Optimal plan on a flat cluster by MILP (small profiles only).

    Raises:
        PlanError: hierarchical clusters, a memory limit with a synchronous schedule, or a problem
            too large for the ILP.
        InfeasibleError: the solver finds no plan within the memory limit.
    """
    if len(cluster.levels) > 1:
        raise PlanError("--solver ilp handles one level (--gpus); use --solver dp for --topology")
    import pulp

    bottleneck = schedule_model(schedule).asynchronous  # whole minibatches: the slowest stage, else the sum
    if not bottleneck and cluster.memory_bytes is not None:
        raise PlanError("--solver ilp has no memory model for 1f1b/gpipe; drop --memory or use --solver dp")
    start = time.perf_counter()
    states = build_states(profile)
    if not activation_comm:
        states = replace(states, act_bytes=states.act_bytes * 0.0)
    states = states.with_actions(cluster.action_for(schedule), schedule_model(schedule).actions(microbatches))
    m = cluster.gpus
    cap = 1 if straight else m
    prob = LevelProblem(states, m, cluster.levels[0].link)
    pairs = [(k, j) for j in range(1, len(states)) for k in states.pred(j)]
    if len(pairs) * cap > MAX_ILP_VARIABLES:
        raise PlanError(f"the ILP would need {len(pairs) * cap} variables; use --solver dp for this profile")
    model = pulp.LpProblem("pipeplan", pulp.LpMinimize)
    t = model.add_variable("t", lowBound=0)
    x = {(k, j, r): model.add_variable(f"x_{k}_{j}_{r}", cat="Binary")
         for k, j in pairs for r in range(1, cap + 1)
         if _fits(profile, states, k, j, r, m, cluster, optimizer, schedule)}  # fmt: skip
    if bottleneck:
        model += t
        for (k, j, r), v in x.items():
            model += t >= prob.stage_time(k, j, r) * v
    else:
        a = model.add_variable("a", lowBound=0)
        micro = {key: _micro(states, key, microbatches, prob.link) for key in x}
        model += pulp.lpSum(micro[key][0] * v for key, v in x.items()) + (microbatches - 1) * t + a
        for key, v in x.items():
            model += t >= micro[key][0] * v
            model += a >= micro[key][1] * v
    last = len(states) - 1
    for s in range(len(states)):
        out = pulp.lpSum(v for (k, _, _), v in x.items() if k == s)
        into = pulp.lpSum(v for (_, j, _), v in x.items() if j == s)
        model += (out if s == 0 else into if s == last else out - into) == (1 if s in (0, last) else 0)
    model += pulp.lpSum(r * v for (_, _, r), v in x.items()) <= m
    with _quiet_stdout():  # HiGHS prints a banner when it is created, msg=False or not
        status = model.solve(_backend())
    if pulp.LpStatus[status] != "Optimal":
        raise InfeasibleError(f"the ILP found no plan ({pulp.LpStatus[status]}); check --memory")
    chosen = sorted(((k, j, r) for (k, j, r), v in x.items() if (v.value() or 0) > 0.5), key=lambda s: s[1])
    specs, rank = [], 0
    inputs = tuple(n.id for n in profile.nodes if n.op == "input")
    for i, (k, j, r) in enumerate(chosen):
        nodes = states.members(k, j)
        specs.append(StageSpec(inputs + nodes if i == 0 else nodes, r, tuple(range(rank, rank + r))))
        rank += r
    info = SolverInfo("ilp", time.perf_counter() - start, states.exact, global_lower_bound(profile, cluster))
    if not bottleneck:  # the plan's own synchronous price, which the MILP minimised
        plan = assemble(profile, cluster, specs, schedule, microbatches, optimizer, info,
                        activation_comm=activation_comm)  # fmt: skip
        bound = plan.predicted.time_per_minibatch_s if states.exact else None
        return replace(plan, solver=replace(info, lower_bound_s=bound))
    value = max(prob.stage_time(k, j, r) for k, j, r in chosen)
    return assemble(profile, cluster, specs, schedule, 1, optimizer, info, time_override=value,
                    activation_comm=activation_comm)  # fmt: skip


def _micro(states: StateSet, key: tuple[int, int, int], m: int, link: Link) -> tuple[float, float]:
    """(microbatch time, all-reduce time) of stage (k, j] on r replicas, as the synchronous model's."""
    k, j, r = key
    out = float(states.act_bytes[j]) if j < len(states) - 1 else 0.0
    compute = float(states.compute(k, j))
    params = float(states.param_bytes[j] - states.param_bytes[k])
    return microbatch_time(compute, out, r, m, link), allreduce_time(params, r, link)


def _fits(
    profile: Profile, states: StateSet, k: int, j: int, r: int, m: int, cluster: Cluster, opt: str,
    schedule: str,
) -> bool:  # fmt: skip
    """Memory filter with PipeDream's worst case in-flight count (all ``m`` devices downstream)."""
    if cluster.memory_bytes is None:
        return True
    limit = MemoryLimit.of(
        float(cluster.memory_bytes), profile, opt, schedule, m, 1, cluster.cores is not None
    )
    ks, js = np.array([k], dtype=np.int64), np.array([j], dtype=np.int64)
    copies, _ = limit.copies(states.masks, states.layer_ids, ks, js)
    p = states.param_bytes[js] - states.param_bytes[ks] + copies
    work = limit.working_of(
        states.masks, states.layer_ids, ks, js, states.act_bytes[ks], states.act_bytes[js]
    )
    items = limit.items(p, states.item_bytes(ks, js), work)
    return bool(items[0] >= -(-m // r))
