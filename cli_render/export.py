"""``pipeplan export``'s output: the file written, what it holds, and what it could not; and the
one line of ``export-plan`` and ``convert-checkpoint``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cli_render.common import console

__all__ = ["print_converted", "print_export", "print_torch_plan"]


def print_export(done: Any, folder: Path) -> None:
    """``done``: runtime.exporting.model_weights's result for the package ``folder``."""
    out, merged = console(), done.merged
    for line in done.skipped:
        console(stderr=True).print(f"skipped {line}", soft_wrap=True, markup=False)
    shards = f" ({len(done.files)} shards)" if done.path.name.endswith(".index.json") else ""
    out.print(
        f"wrote {done.path}{shards}: step {done.step} of {folder}, {len(merged.loaded)} tensors from the "
        f"checkpoint" + (f", {len(merged.tied)} tied names filled in" if merged.tied else ""),
        soft_wrap=True,
        markup=False,
    )
    if merged.untrained:
        kept = (
            "left out (from_pretrained initialises them)"
            if done.path.suffix in (".safetensors", ".json")
            else f"kept at full_model(seed={done.seed})'s values, untrained"
        )
        out.print(
            f"[yellow]note:[/yellow] no stage holds {len(merged.untrained)} tensors (e.g. "
            f"{merged.untrained[0]}): {kept}",
            soft_wrap=True,
        )
    if merged.tie_max_diff > 0:
        out.print(
            f"[yellow]note:[/yellow] the stages' copies of a tied weight differ by up to "
            f"{merged.tie_max_diff:.3g}; the first stage's copy was kept",
            soft_wrap=True,
        )
    if done.hf_dir is not None:
        out.print(f"wrote {done.hf_dir} (config and safetensors; from_pretrained reads it)", soft_wrap=True)


def print_torch_plan(plan: Any, out: Path) -> None:
    """``plan``: runtime.exporting.torch_plan's result, written to ``out``."""
    console().print(
        f"wrote {out}/schedule.csv, stages.json, torchtitan.toml: {len(plan.stages)} stages, "
        f"{plan.schedule}, {plan.microbatches} microbatches per minibatch of {plan.batch_size}",
        soft_wrap=True,
        markup=False,
    )


def print_converted(steps: Sequence[int], checkpoint_dir: str) -> None:
    """The old per-stage checkpoints of ``checkpoint_dir`` rewritten, by step."""
    console().print(
        f"converted {', '.join(f'step-{s}' for s in steps)} of {checkpoint_dir} (old files in step-N.v1/)",
        soft_wrap=True,
        markup=False,
    )
