"""``pipeplan probe``'s output: each level's link and the all-reduces, medians and their spread."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cli_render.common import console, new_table

if TYPE_CHECKING:  # (types only: this module prints, runtime.probe measures)
    from runtime.probe import ProbeOptions, ProbeOutcome

__all__ = ["print_probe", "print_probing"]


def print_probing(options: ProbeOptions) -> None:
    """Say what is measured, before the ranks start."""
    cores = "cores busy" if options.busy else "idle"
    console(stderr=True).print(
        f"probing {options.gpus * options.nnodes} ranks ({options.device}, {cores}) ..."
    )


def print_probe(outcome: ProbeOutcome | None, output: str) -> None:
    """The links' table (node 0; the other nodes, ``outcome`` None, print nothing more)."""
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
