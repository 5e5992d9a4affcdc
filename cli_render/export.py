"""``pipeplan export``'s output: the file written, what it holds, and what it could not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cli_render.common import console

__all__ = ["print_export"]


def print_export(done: Any, folder: Path) -> None:
    """``done``: runtime.export's result for the package ``folder``."""
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
