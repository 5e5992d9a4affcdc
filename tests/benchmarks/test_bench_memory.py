"""The memory benchmark's own arithmetic: what it adds as unpriced, and recomputation's ratios."""

from __future__ import annotations

from typing import Any

from benchmarks.bench_memory import recompute_cost, unpriced_bytes

PROFILE = {
    "nodes": [
        {"id": "x", "param_bytes": 0},
        {"id": "emb", "param_bytes": 100, "param_names": ["wte.weight"]},
        {"id": "fc", "param_bytes": 30},
        {"id": "head", "param_bytes": 0, "param_names": ["head.weight"]},
    ]
}


def _plan(schedule: str, microbatches: int) -> dict[str, Any]:
    return {
        "schedule": schedule,
        "microbatches": microbatches,
        "optimizer": "sgd",
        "stages": [{"nodes": ["x", "emb", "fc"], "replicas": 1}, {"nodes": ["head"], "replicas": 1}],
        "ties": [{"name": "wte.weight", "members": [[0, "wte.weight"], [1, "head.weight"]]}],
    }


def test_unpriced_per_schedule() -> None:
    # the tied weight's copy on stage 1: weight + gradient (sgd) = 200; accumulating over 4
    # microbatches adds the largest layer's gradient: 100 on stage 0, the tied copy's 100 on stage 1
    assert unpriced_bytes(_plan("1f1b", 4), PROFILE) == [100.0, 300.0]
    assert unpriced_bytes(_plan("gpipe", 1), PROFILE) == [0.0, 200.0]  # one microbatch: no accumulation
    # pipedream: stage 0 holds 2 minibatches, so a snapshot of its 130 bytes beside the live weights
    assert unpriced_bytes(_plan("pipedream", 1), PROFILE) == [130.0, 200.0]


def test_recompute_cost_pairs_runs_of_one_model_and_schedule() -> None:
    def run(recompute: str, seconds: float, nbytes: int) -> dict[str, Any]:
        stages = [{"measured_bytes": nbytes, "predicted_bytes": nbytes * 2}]
        times = {"measured_s": seconds, "compute_cpu_s_per_minibatch": seconds, "predicted_s": seconds * 2}
        return {"model": "m", "schedule": "1f1b", "recompute": recompute, "stages": stages, **times}

    (cost,) = recompute_cost([run("none", 1.0, 100), run("all", 1.5, 60)])
    assert (cost["time_measured"], cost["time_compute_cpu"], cost["time_predicted"]) == (1.5, 1.5, 1.5)
    assert cost["memory_measured"] == [0.6] and cost["memory_predicted"] == [0.6]
