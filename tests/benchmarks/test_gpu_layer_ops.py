"""benchmarks/gpu_layer_ops.py's CPU mode: both attention forms are timed and broken down, so the
script cannot rot between the sessions that have a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_layer_ops

pytest.importorskip("transformers")


def test_cpu_mode_times_both_attention_forms(tmp_path: Path) -> None:
    assert gpu_layer_ops.main(["--cpu", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "layer_ops.json").read_text())
    row = report["rows"]["llama-h512"]
    for kind in ("causal", "masked"):
        assert row[kind]["forward_ms"] > 0 and row[kind]["step_ms"] > row[kind]["forward_ms"]
        assert sum(row[kind]["kinds"]["ms"].values()) > 0
    assert row["linears_forward_ms"] > 0
    assert "| llama-h512 | 64 | masked |" in (tmp_path / "layer_ops.md").read_text()
