"""The memory benchmark's own arithmetic: recomputation's ratios."""

from __future__ import annotations

from typing import Any

from benchmarks.bench_memory import recompute_cost


def test_recompute_cost_pairs_runs_of_one_model_and_schedule() -> None:
    def run(recompute: str, seconds: float, nbytes: int) -> dict[str, Any]:
        stages = [{"measured_bytes": nbytes, "predicted_bytes": nbytes * 2}]
        times = {"measured_s": seconds, "compute_cpu_s_per_minibatch": seconds, "predicted_s": seconds * 2}
        return {"model": "m", "schedule": "1f1b", "recompute": recompute, "stages": stages, **times}

    (cost,) = recompute_cost([run("none", 1.0, 100), run("all", 1.5, 60)])
    assert (cost["time_measured"], cost["time_compute_cpu"], cost["time_predicted"]) == (1.5, 1.5, 1.5)
    assert cost["memory_measured"] == [0.6] and cost["memory_predicted"] == [0.6]
