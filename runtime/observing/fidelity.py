"""Per stage, what a run measured against what its plan predicted: compute, communication and
bubble per minibatch, beside the total that metrics.json already compares (memory per stage is
metrics.json's ``memory``: each stage links to its entry there).

The two sides of a figure must mean the same thing for their ratio to mean anything;
docs/fidelity.md says what each is. In short: compute and bubble compare like for like and carry a
ratio; communication does not (the runtime's is the time a rank was blocked, waiting for its peer
included; the plan's is the wire time of its messages), so it is reported on both sides with no
ratio, and the time a rank waits shows in its bubble.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from runtime.observing.metrics import RankMetrics
from runtime.packages.job_config import StagePrediction

__all__ = ["stage_report"]


def stage_report(
    stages: Sequence[Mapping[str, Any]],
    ranks: Sequence[RankMetrics],
    predicted: Sequence[StagePrediction],
    warmup: int,
) -> list[dict[str, Any]]:
    """metrics.json's ``stages`` (each with its measured ``compute_s_per_minibatch``) with the
    measured communication and bubble and, where the plan predicts them, the predictions and
    measured/predicted ratios. A rank hosting several stages reports under its first: its
    predictions are then its stages' summed (the bubble is the rank's already)."""
    out = []
    for i, entry in enumerate(stages):
        stage = int(entry["stage"])
        mine = [r for r in ranks if r.stage == stage]
        want = _hosted(predicted, mine[0].hosted or (stage,)) if mine else StagePrediction()
        comm = statistics.fmean(_comm_per_minibatch(r, warmup) for r in mine) if mine else None
        bubble = statistics.fmean(_bubble(r, warmup) for r in mine) if mine else None
        got = float(entry["compute_s_per_minibatch"])
        out.append({
            **entry,
            "predicted_compute_s_per_minibatch": want.compute_s,
            "compute_measured_over_predicted": got / want.compute_s if want.compute_s else None,
            "comm_s_per_minibatch": comm,
            "predicted_comm_s_per_minibatch": want.comm_s,
            "bubble_fraction": bubble,
            "predicted_bubble_fraction": want.bubble,
            "bubble_measured_over_predicted": _ratio(bubble, want.bubble),
            "bubble_difference": _difference(bubble, want.bubble),
            "memory": f"#/memory/stages/{i}",
        })  # fmt: skip
    return out


def _hosted(predicted: Sequence[StagePrediction], hosted: Sequence[int]) -> StagePrediction:
    """The predictions of a rank's stages together: times summed, the bubble the rank's (each of its
    stages carries the same); None where any of them is not predicted."""
    if not hosted or any(s >= len(predicted) for s in hosted):
        return StagePrediction()
    mine = [predicted[s] for s in hosted]
    compute, comm = [p.compute_s for p in mine], [p.comm_s for p in mine]
    return StagePrediction(
        sum(c for c in compute if c is not None) if None not in compute else None,
        sum(c for c in comm if c is not None) if None not in comm else None,
        mine[0].bubble,
    )


def _timed(series: Sequence[float], warmup: int) -> Sequence[float]:
    """The steps after the warm-up, as the time per minibatch takes them (all of them if none)."""
    return series[warmup:] or series


def _comm_per_minibatch(rank: RankMetrics, warmup: int) -> float:
    """The rank's median seconds per minibatch blocked in communication (its whole run's mean where
    it recorded no per-step figures)."""
    if rank.step_comm_s:
        return statistics.median(_timed(rank.step_comm_s, warmup))
    return rank.comm_s / max(1, len(rank.step_times_s))


def _bubble(rank: RankMetrics, warmup: int) -> float:
    """The share of the rank's timed steps it spent not computing (blocked in communication or idle)."""
    if rank.step_compute_s and len(rank.step_compute_s) == len(rank.step_times_s):
        compute, wall = sum(_timed(rank.step_compute_s, warmup)), sum(_timed(rank.step_times_s, warmup))
    else:
        compute, wall = rank.compute_s, rank.wall_s
    return min(1.0, max(0.0, 1.0 - compute / wall)) if wall > 0 else 0.0


def _difference(measured: float | None, predicted: float | None) -> float | None:
    return measured - predicted if measured is not None and predicted is not None else None


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    return measured / predicted if measured is not None and predicted else None
