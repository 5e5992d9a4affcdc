"""Shared by the codegen and verify tests: a profile and a plan without measuring anything.

The profile comes from the profiler's own trace and layer grouping (so node ids and ``members`` are
exactly what ``pipeplan profile`` writes); times are left at zero because code generation ignores them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from partitioner.graph import Node, Profile
from partitioner.models.specs import ModelBundle, load_model
from partitioner.plan import Cluster, Plan, Prediction, SolverInfo, Stage
from partitioner.profiler.trace import Traced, trace_model

__all__ = ["HF_GPT2", "plan_for", "profile_for", "profile_of"]

HF_GPT2 = f"{Path(__file__).with_name('hf_gpt2_model.py')}:gpt2_4layer"


def profile_for(spec: str, batch_size: int = 2, input_shape: tuple[int, ...] | None = None) -> Profile:
    """An unmeasured profile of ``spec``: the traced layers and how to re-trace them."""
    bundle = load_model(spec, batch_size, input_shape)
    return profile_of(bundle, trace_model(bundle, (), input_shape))


def profile_of(bundle: ModelBundle, traced: Traced) -> Profile:
    """:func:`profile_for` of a model already loaded and traced."""
    nodes = tuple(
        Node(id=g.id, name=g.name, op=g.op, target=g.target, members=g.members) for g in traced.groups
    )
    return Profile(
        nodes=nodes,
        model=bundle.spec,
        batch_size=bundle.batch_size,
        tracer=traced.tracer,
        tracer_options=dict(traced.options),
    )


def plan_for(profile: Profile, cuts: Sequence[int], replicas: Sequence[int] | None = None) -> Plan:
    """Stages from cut positions in the profile's node list; ranks contiguous, as the optimizer assigns."""
    ids = [n.id for n in profile.nodes]
    bounds = [0, *cuts, len(ids)]
    widths = list(replicas) if replicas else [1] * (len(bounds) - 1)
    stages, rank = [], 0
    for k, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        stages.append(Stage(k, tuple(ids[lo:hi]), widths[k], tuple(range(rank, rank + widths[k]))))
        rank += widths[k]
    return Plan(
        gpus=rank,
        cluster=Cluster.flat(rank),
        schedule="pipedream",
        microbatches=1,
        stages=tuple(stages),
        predicted=Prediction(1.0),
        solver=SolverInfo("manual", 0.0, False),
        batch_size=profile.batch_size,
        model=profile.model,
    )
