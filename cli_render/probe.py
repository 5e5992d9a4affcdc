"""``pipeplan probe``'s output: each level's link and the all-reduces, medians and their spread."""

from __future__ import annotations

from collections.abc import Callable

from cli_render.common import console, new_table
from runtime.job.link_probe import ProbeOptions, ProbeOutcome

__all__ = ["print_probe"]


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
