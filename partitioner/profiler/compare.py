"""How far an estimated profile is from a measured one of the same model: per layer and in total.

``compare(measured, estimated)`` pairs the layers of two profiles of one model (same spec, batch,
tracer: the same node ids) and reports the estimate over the measurement, forward, backward and
both: the median ratio and its spread (the 10th and 90th percentiles), the layers furthest off
(weighted by the time they take, so a 1 us layer off by 10x does not hide a 10 ms one off by 2x),
and the sums against the measured whole step. The GPU kit (benchmarks/gpu_check.py) calls it on
the profiles it measures, ``benchmarks/bench_device_model.py`` on the committed ones. Plain Python.

Example:
    >>> report = compare(load_profile("measured.json"), load_profile("estimated.json"))
    >>> report["total"]["median"]  # doctest: +SKIP
    0.93
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from partitioner.errors import PipeplanError
from partitioner.graph import Node, Profile, scale_batch

__all__ = ["compare", "spread"]


def spread(ratios: Sequence[float]) -> dict[str, float | int | None]:
    """Median, 10th and 90th percentiles, geometric mean and count of positive ratios."""
    values = sorted(r for r in ratios if r > 0 and math.isfinite(r))
    if not values:
        return {"n": 0, "median": None, "p10": None, "p90": None, "geomean": None}

    def at(q: float) -> float:
        return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]

    geomean = math.exp(statistics.fmean(math.log(v) for v in values))
    return {
        "n": len(values),
        "median": statistics.median(values),
        "p10": at(0.1),
        "p90": at(0.9),
        "geomean": geomean,
    }


def compare(measured: Profile, estimated: Profile, worst: int = 5, floor_ms: float = 0.0) -> dict[str, Any]:
    """Estimated over measured, per layer (pairs whose measured time exceeds ``floor_ms``) and summed.

    The estimate is rescaled to the measured profile's batch size when they differ.

    Raises:
        PipeplanError: the profiles share no layers (different models or tracers).
    """
    if estimated.batch_size and measured.batch_size and estimated.batch_size != measured.batch_size:
        estimated = scale_batch(estimated, measured.batch_size)
    pairs = [(m, e) for m, e in _pairs(measured, estimated) if m.compute_ms > floor_ms]
    if not pairs:
        raise PipeplanError(
            f"the profiles share no layers: {measured.model} ({measured.tracer}) against "
            f"{estimated.model} ({estimated.tracer}); compare profiles of one model, traced alike"
        )
    layers_m = math.fsum(m.compute_ms for m, _ in pairs)
    layers_e = math.fsum(e.compute_ms for _, e in pairs)
    every_e = estimated.total_compute_ms
    return {
        "model": measured.model,
        "measured_on": measured.device,
        "estimated_for": estimated.device,
        "layers": len(pairs),
        "forward": spread([_ratio(e.forward_ms, m.forward_ms) for m, e in pairs]),
        "backward": spread([_ratio(e.backward_ms, m.backward_ms) for m, e in pairs if m.backward_ms > 0]),
        "total": spread([_ratio(e.compute_ms, m.compute_ms) for m, e in pairs]),
        "sum_measured_ms": layers_m,
        "sum_estimated_ms": layers_e,
        "sum_ratio": layers_e / layers_m if layers_m else None,
        "step_measured_ms": measured.step_ms,
        "estimated_total_ms": every_e,
        "step_ratio": every_e / measured.step_ms if measured.step_ms else None,
        "worst": [_row(m, e) for m, e in sorted(pairs, key=_weight, reverse=True)[:worst]],
    }


def _pairs(measured: Profile, estimated: Profile) -> list[tuple[Node, Node]]:
    """Layers of both profiles: by node id, else by name where the name is unique on both sides (a
    graph exported with a dynamic batch names a few nodes differently from a static one)."""
    by_id = {n.id: n for n in estimated.layers}
    names_m = [n.name for n in measured.layers]
    by_name = {n.name: n for n in estimated.layers if [e.name for e in estimated.layers].count(n.name) == 1}
    taken = {n.id for n in measured.layers if n.id in by_id}
    pairs = []
    for m in measured.layers:
        if m.id in by_id:
            pairs.append((m, by_id[m.id]))
        elif names_m.count(m.name) == 1 and m.name in by_name and by_name[m.name].id not in taken:
            pairs.append((m, by_name[m.name]))
    return pairs


def _ratio(estimated: float, measured: float) -> float:
    return estimated / measured if measured > 0 else math.inf


def _weight(pair: tuple[Node, Node]) -> float:
    """How much a layer's error costs: its measured time times how far off (in log) its estimate is."""
    m, e = pair
    if m.compute_ms <= 0 or e.compute_ms <= 0:
        return 0.0
    return m.compute_ms * abs(math.log(e.compute_ms / m.compute_ms))


def _row(m: Node, e: Node) -> dict[str, Any]:
    return {
        "id": m.id,
        "name": m.name,
        "target": m.target,
        "measured_ms": round(m.compute_ms, 4),
        "estimated_ms": round(e.compute_ms, 4),
        "ratio": round(_ratio(e.compute_ms, m.compute_ms), 3),
    }
