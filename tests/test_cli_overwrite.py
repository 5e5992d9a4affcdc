"""A second `partition` never replaces, by surprise, the package a run came from: another plan over a
trained package is refused in one line naming what differs, and `--force` replaces it keeping its
runs; the same plan again is rewritten as before."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from cli import main
from partitioner.graph import save_profile


def _partition(profile: Path, out: Path, *extra: str) -> tuple[int, str]:
    args = ["partition", "--profile", str(profile), "--gpus", "2", "--straight", "-o", str(out), *extra]
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


def test_another_plan_over_a_trained_package_needs_force(tmp_path: Path) -> None:
    from tests.partitioner.codegen_support import profile_for

    save_profile(profile_for("tiny-mlp"), tmp_path / "p.json")
    code, out = _partition(tmp_path / "p.json", tmp_path, "--schedule", "1f1b")
    assert code == 0, out
    package = tmp_path / "tiny-mlp" / "gpus=2"
    code, out = _partition(tmp_path / "p.json", tmp_path, "--schedule", "gpipe")  # no runs: replaced
    assert code == 0, out
    (package / "runs" / "20260101-000000").mkdir(parents=True)
    (package / "runs" / "20260101-000000" / "metrics.json").write_text("{}")
    (package / "run").symlink_to("runs/20260101-000000")
    plan = (package / "plan.json").read_bytes()

    code, out = _partition(tmp_path / "p.json", tmp_path, "--schedule", "1f1b")
    assert code == 2 and out.count("\n") == 1, out
    assert out.startswith(f"error: {package} holds the package its runs (run/, runs/) were trained from")
    assert "schedule gpipe -> 1f1b" in out and "give --force to replace it" in out, out
    assert (package / "plan.json").read_bytes() == plan and (package / "run").is_symlink()  # untouched

    code, out = _partition(tmp_path / "p.json", tmp_path, "--schedule", "1f1b", "--force")
    assert code == 0, out
    (kept,) = [p.name for p in package.glob("runs.*")]
    assert (package / kept / "20260101-000000" / "metrics.json").read_text() == "{}"
    assert '"schedule": "1f1b"' in (package / "plan.json").read_text()
