"""Small layer DAGs with integer costs, shared by the optimizer tests."""

from __future__ import annotations

from collections.abc import Sequence

from partitioner.graph import Node, Profile
from partitioner.plan import Plan


def make_profile(
    costs: Sequence[tuple[int, int, int, int]], edges: Sequence[tuple[int, int]], batch_size: int = 8
) -> Profile:
    """Layers ``l0..`` with (forward ms, backward ms, output bytes, param bytes); one input feeds l0.

    ``edges`` are (src, dst) layer indices with src < dst; a layer without inputs reads the input.
    """
    readers: dict[int, list[str]] = {i: [] for i in range(len(costs))}
    for src, dst in edges:
        readers[dst].append(f"l{src}")
    nodes = [Node("x", "x", "input", "Input", output_bytes=1000)]
    for i, (fwd, bwd, out, params) in enumerate(costs):
        inputs = tuple(sorted(set(readers[i]))) or ("x",)
        nodes.append(
            Node(
                f"l{i}",
                f"layer{i}",
                "call_module",
                "Linear",
                inputs,
                float(fwd),
                float(bwd),
                out,
                out,
                params,
            )
        )
    return Profile(tuple(nodes), model="toy", batch_size=batch_size, tracer="pipedream")


def searched_s(plan: Plan) -> float:
    """The time the search minimised: the closed form's, where the plan is priced by simulation."""
    return float(plan.extra.get("closed_form_s", plan.predicted.time_per_minibatch_s))
