"""Packages written by the code generator from a built-in model, for runtime tests that need what only
a generated package records (input shapes, output classes, a real criterion)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["generate"]


def generate(
    out: Path,
    spec: str,
    replicas: Sequence[int],
    schedule: str = "1f1b",
    microbatches: int = 1,
    batch_size: int = 4,
    input_shape: tuple[int, ...] | None = None,
) -> Path:
    """Profile ``spec`` once and write a package of ``len(replicas)`` stages with equal layer counts,
    stage ``k`` on ``replicas[k]`` consecutive ranks."""
    from partitioner import plan
    from partitioner.generation import codegen
    from partitioner.profiler import profile as profiler

    profile = profiler.profile_model(spec, batch_size=batch_size, input_shape=input_shape, repeats=1)
    ids = [n.id for n in profile.nodes]
    count = len(replicas)
    cuts = [round(i * len(ids) / count) for i in range(count + 1)]
    first = [sum(replicas[:k]) for k in range(count)]
    stages = tuple(
        plan.Stage(k, tuple(ids[cuts[k] : cuts[k + 1]]), r, tuple(range(first[k], first[k] + r)))
        for k, r in enumerate(replicas)
    )
    made = plan.Plan(
        gpus=sum(replicas),
        cluster=plan.Cluster.flat(sum(replicas)),
        schedule=schedule,
        microbatches=microbatches,
        stages=stages,
        predicted=plan.Prediction(0.01),
        solver=plan.SolverInfo("test", 0.0, True),
        batch_size=batch_size,
        model=profile.model,
    )
    codegen.write_package(profile, made, out)
    return out
