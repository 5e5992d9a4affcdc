"""The 3D memory price and the runtime agree: a sharded stage's plan.json peak (priced by
``evaluate_layout``, partitioner/optimizer/pricing/) is within 10% of what each rank measures with
``--measure-memory`` (benchmarks/bench_3d_memory.py runs the whole matrix)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.runtime.helpers import run
from tests.runtime.packages3d import LLAMA, config_file

profiler = pytest.importorskip("partitioner.profiler.profile")

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


def test_each_rank_of_a_sharded_llama_shaped_plan_holds_its_price(tmp_path: Path) -> None:
    """PP2 x DP2 at ``gradients`` (4 ranks, Adam, 2 steps: the second holds the optimizer state):
    the stage is FSDP2's one unit and the peak is its step's reduce-scatter (docs/layout-3d.md),
    which the price charges."""
    from partitioner.generation import codegen
    from partitioner.optimizer.layouts import evaluate_layout
    from partitioner.optimizer.pricing.layout import Layout
    from partitioner.partition import cluster_of, cpu_hosts

    profile = profiler.profile_model(config_file(tmp_path, LLAMA), batch_size=8, repeats=1)
    ids = [n.id for n in profile.nodes]
    cluster = cpu_hosts(cluster_of(4, None, None, None), profile, None)
    plan = evaluate_layout(
        profile, cluster, Layout(1, 2, "gradients"), [ids[len(ids) // 2 - 1]], "1f1b", 2, "adam"
    )
    codegen.write_package(profile, plan, tmp_path / "pkg")
    metrics = run(tmp_path / "pkg", steps=2, optimizer="adam", lr=1e-3, measure_memory=True,
                  checkpoint_dir=str(tmp_path / "ckpt"), timeout=120)  # fmt: skip
    for r in metrics["ranks"]:
        ratio = r["peak_memory_bytes"] / plan.stages[r["stage"]].memory_bytes
        assert 0.9 <= ratio <= 1.1, f"rank {r['rank']} (stage {r['stage']}): measured/predicted {ratio:.3f}"
