"""``pipeplan probe``'s output: each level's link and the all-reduces, medians and their spread."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cli_render.common import console, new_table
from runtime.probe import ProbeOptions, ProbeOutcome

__all__ = ["print_actions", "print_probe"]


def print_probe(options: ProbeOptions, measure: Callable[[], ProbeOutcome | None], output: str) -> None:
    """Say what is measured, measure, and show the table (node 0; the other nodes print nothing more)."""
    cores = "cores busy" if options.busy else "idle"
    console(stderr=True).print(
        f"probing {options.gpus * options.nnodes} ranks ({options.device}, {cores}) ..."
    )
    outcome = measure()
    if outcome is None:
        return  # another node: node 0 writes the file
    table = new_table(
        f"links, {outcome.ranks} ranks on {outcome.backend} -> {output}", outcome.columns, ["level"]
    )
    for row in outcome.rows:
        table.add_row(*row)
    out = console()
    out.print(table)
    for line in outcome.notes:
        out.print(line)


def print_actions(path: Path, device: str) -> None:
    """Time the runtime's cost per action (:mod:`partitioner.action_probe`), write it into the
    cluster file at ``path`` and say so."""
    from partitioner.action_probe import probe_actions, record_actions

    console(stderr=True).print("timing the runtime's own cost per action (a short traced run) ...")
    found = probe_actions(2, "cuda" if device == "cuda" else "cpu")
    record_actions(path, found)
    console().print(
        f"time per action {found.action_s * 1e3:.3f} ms (mean of {found.actions} actions' gaps, median "
        f"{found.median_s * 1e3:.3f} ms) -> {path}'s action_overhead"
    )
