"""benchmarks/reporting.py: every benchmark's results pair is written whole, and its tables read."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.reporting import free_port, machine, table, write_results


def test_a_results_pair_is_written_together_from_lines_or_a_page(tmp_path: Path) -> None:
    write_results(tmp_path / "r", "bench_x", {"a": 1}, ["# x", "", "| a |"])
    assert json.loads((tmp_path / "r" / "bench_x.json").read_text()) == {"a": 1}
    assert (tmp_path / "r" / "bench_x.md").read_text() == "# x\n\n| a |\n"
    write_results(tmp_path / "r", "bench_x", {"p": Path("/p")}, "page\n", default=str)
    assert json.loads((tmp_path / "r" / "bench_x.json").read_text()) == {"p": "/p"}
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["bench_x.json", "bench_x.md"]


def test_a_table_aligns_the_columns_it_is_told_to() -> None:
    assert table(["n", "ms"], [(1, "2.0")], "lr") == ["| n | ms |", "|---|---:|", "| 1 | 2.0 |"]


def test_a_free_port_and_the_machine_record() -> None:
    assert 0 < free_port() < 65536
    record = machine([1.0, 2.0], note="x")
    assert record["load_average_before_after"] == [1.0, 2.0] and record["note"] == "x" and record["cpu_count"]
