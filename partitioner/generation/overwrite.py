"""What a second ``pipeplan partition`` may replace: never, by surprise, the package a run came from.

A package folder that holds runs (``run``, ``runs/``) was trained: its checkpoints belong to its
stages. Partitioning into it again with a plan that lays the model out otherwise (other cuts,
replicas, schedule, microbatches, batch size, precision) is refused unless ``--force`` is given (the
runs then move into the new package as ``runs.<time>/``, as before). The same plan, or a folder
without runs, is rewritten as always. No torch: the plans are compared as plan.json records them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from partitioner.errors import PipeplanError, PlanError
from partitioner.plan import Plan, load_plan

__all__ = ["check_replace", "differences", "trained_runs"]


def trained_runs(out_dir: Path) -> list[Path]:
    """The runs a package folder holds (``run``, and ``runs/`` when it is not empty)."""
    runs = out_dir / "runs"
    found = [out_dir / "run"] if (out_dir / "run").exists() or (out_dir / "run").is_symlink() else []
    if runs.is_dir() and any(runs.iterdir()):
        found.append(runs)
    return found


def _layout(plan: Plan) -> dict[str, Any]:
    """What a run of the package depends on, by the words partition's options use."""
    return {
        "model": plan.model,
        "schedule": plan.schedule,
        "microbatches": plan.microbatches,
        "virtual stages": plan.virtual_stages,
        "batch size": plan.batch_size,
        "precision": plan.precision,
        "cuts": [(s.nodes[0], s.nodes[-1]) if s.nodes else () for s in plan.stages],
        "replicas": [s.replicas for s in plan.stages],
        "recompute": [s.recompute for s in plan.stages],
    }


def differences(old: Plan, new: Plan) -> list[str]:
    """Each way ``new`` lays the model out otherwise than ``old``, as ``what old -> new``."""
    a, b = _layout(old), _layout(new)
    out = []
    for key in a:
        if a[key] != b[key]:
            if key in ("cuts", "recompute"):
                out.append(f"{key} differ ({len(old.stages)} -> {len(new.stages)} stages)")
            else:
                out.append(f"{key} {_shown(a[key])} -> {_shown(b[key])}")
    return out


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def check_replace(out_dir: Path, plan: Plan, force: bool) -> None:
    """Refuse to replace a trained package with another plan, unless ``force``.

    Raises:
        PlanError: ``out_dir`` holds runs and a plan that differs from ``plan`` (or none readable).
    """
    runs = trained_runs(out_dir)
    if force or not runs or not (out_dir / "plan.json").is_file():
        return
    try:
        changed = differences(load_plan(out_dir / "plan.json"), plan)
    except (PipeplanError, OSError, ValueError, KeyError, TypeError):
        changed = ["its plan.json does not read"]
    if changed:
        raise PlanError(
            f"{out_dir} holds the package its runs ({', '.join(p.name + '/' for p in runs)}) were trained "
            f"from, and this plan differs ({'; '.join(changed)}): give --force to replace it (its runs "
            "move into the new package as runs.<time>/), or -o another folder"
        )
