"""The GPU kit's CPU mode: every step runs and the report is complete, so the kit cannot rot between the
rare sessions that have a GPU. The ``3d`` step (its one-rank paths on gloo, the code the GPU runs on
nccl) has a test of its own."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import gpu_3d_one_rank, gpu_check

BUT_3D = [name for name in gpu_check.STEPS if name != "3d"]


def test_cpu_mode_writes_a_complete_report(tmp_path: Path) -> None:
    argv = ["--cpu", "--out", str(tmp_path), "--work", str(tmp_path / "work"), "--steps", ",".join(BUT_3D)]
    assert gpu_check.main(argv) == 0
    report = json.loads((tmp_path / "cpu_check.json").read_text())
    steps = report["steps"]
    assert set(steps) == set(BUT_3D)
    assert not [name for name, step in steps.items() if "error" in step]
    assert steps["env"]["cuda_available"] in (True, False) and steps["env"]["cpus"]
    assert all(rate > 0 for rate in steps["ceilings"]["matmul_tflops"]["float32"].values())
    profiles = steps["profile"]
    assert [p["rc"] for p in profiles.values()] == [0] * len(gpu_check.CPU_MODELS)
    assert all(p["layers"] > 0 and p["fidelity"] > 0 for p in profiles.values())
    estimates = steps["estimate"]
    assert estimates["device_model"] == "cpu"
    for name in profiles:
        compared = estimates[name]["compare"]  # the cpu device model against this CPU's measurement
        assert compared["layers"] > 0 and compared["total"]["median"] > 0 and compared["sum_ratio"] > 0
    rows = steps["run"]["rows"]
    expected = sum(len(v.precisions) for v in gpu_check.VARIANTS) * len(gpu_check.CPU_MODELS)
    assert len(rows) == expected
    assert all(r["rc"] == 0 and r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in rows)
    assert all(r["plain"]["step_ms"] > 0 for r in rows)
    assert {r["microbatches"] for r in rows if r["variant"].startswith("zbv")} == {4}
    page = (tmp_path / "cpu_check.md").read_text()
    assert "## Profiles" in page and "## One-rank runs" in page and "Failed steps" not in page
    assert "## Device model `cpu` against the measured profiles" in page


def test_a_failed_step_is_reported_and_the_rest_go_on() -> None:
    report = {
        "date": "2026-01-01",
        "command": "gpu_check.py",
        "steps": {"env": {"gpu": None}, "ceilings": {"error": "RuntimeError: boom"}},
    }
    page = gpu_check.markdown(report)
    assert "## Failed steps" in page and "ceilings: RuntimeError: boom" in page


def test_3d_step_runs_the_runtimes_3d_paths_on_one_gloo_rank(tmp_path: Path) -> None:
    argv = ["--cpu", "--steps", "3d", "--out", str(tmp_path), "--work", str(tmp_path / "work")]
    assert gpu_check.main(argv) == 0
    three = json.loads((tmp_path / "cpu_check.json").read_text())["steps"]["3d"]
    assert list(three["one_rank"]) == list(gpu_check.ONE_RANK_MODELS["cpu"]) == ["mlp"]
    one = three["one_rank"]["mlp"]
    assert one["rc"] == 0 and one["backend"] == "gloo" and one["device"] == "cpu"
    assert "error" not in one and "running" not in one
    assert all(moved > 1e-3 for moved in one["plain_moved"].values())  # equal to weights that trained
    assert one["plain_noise"] == {"fp32": 0.0, "bf16": 0.0}  # one CPU thread: plain twice is plain
    paths = one["paths"]
    assert tuple(paths) == gpu_3d_one_rank.PATHS
    assert [name for name, row in paths.items() if not row["ran"] or "error" in row] == []
    assert paths["mesh"]["result"] == "built" and paths["mesh"]["mesh_shape"] == [1, 1]
    for way in gpu_3d_one_rank.WAYS:
        row = paths[way.name]
        assert row["result"] == "equal", (way.name, row)
        assert row["precision"] == way.precision and row["dtensor_params"] > 0
        assert row["max_rel_error"] <= gpu_3d_one_rank.TOLERANCE[way.precision]
        assert (row.get("layers_split", 0) > 0) == way.tensor
        assert ("fsdp_module" in row) == (way.shard != "none")
        if way.checkpoint:
            assert row["checkpoint_step"] == gpu_3d_one_rank.STEPS
            assert row["written_max_abs"] == 0 and row["loaded_max_abs"] == 0
            assert row["resumed_max_rel_error"] <= gpu_3d_one_rank.TOLERANCE[way.precision]
    assert three["needs"] == list(gpu_check.NEEDS_SEVERAL_GPUS) and "skipped" in three
    page = (tmp_path / "cpu_check.md").read_text()
    assert "## 3D layouts" in page and "One rank, mlp, gloo on cpu (rc 0" in page
    assert "- dcp_shard_full: equal" in page and "Failed steps" not in page
