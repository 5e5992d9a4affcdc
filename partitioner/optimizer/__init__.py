"""Choose pipeline stages and per-stage replication for a profile on a cluster.

Pure Python + numpy (no torch). The front door: :func:`solve` searches, :func:`evaluate` prices a
given plan, :func:`solve_auto` tries every schedule; :class:`SolveOptions` carries what they are
asked for. Behind it, :mod:`~partitioner.optimizer.planner` decides which search runs and what it
falls back to, and two wings do the work: ``pricing`` (the cost model: a stage's time, one
``ScheduleModel`` per schedule, the memory model, the simulation) and ``search`` (the exact and
candidate searches, which know no schedule by name). docs/design.md maps them.

Example:
    >>> from partitioner.graph import read_graph_txt
    >>> from partitioner.plan import Cluster
    >>> plan = solve(read_graph_txt("vgg16/graph.txt", 128), Cluster.flat(4))  # doctest: +SKIP
    >>> [s.replicas for s in plan.stages]  # doctest: +SKIP
"""

from __future__ import annotations

from partitioner.optimizer.auto import solve_auto
from partitioner.optimizer.options import SolveOptions
from partitioner.optimizer.planner import evaluate, solve, solve_with

__all__ = ["SolveOptions", "evaluate", "solve", "solve_auto", "solve_with"]
