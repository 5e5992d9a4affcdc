"""The GPU kit's CPU mode: every step runs and the report is complete, so the kit cannot rot between the
rare sessions that have a GPU."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import gpu_check


def test_cpu_mode_writes_a_complete_report(tmp_path: Path) -> None:
    assert gpu_check.main(["--cpu", "--out", str(tmp_path), "--work", str(tmp_path / "work")]) == 0
    report = json.loads((tmp_path / "cpu_check.json").read_text())
    steps = report["steps"]
    assert set(steps) == set(gpu_check.STEPS)
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
