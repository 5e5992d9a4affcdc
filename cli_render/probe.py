"""``pipeplan probe``'s output: each level's link and the all-reduces, medians and their spread."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cli_render.common import console, new_table

if TYPE_CHECKING:  # (types only: this module prints, runtime.job.link_probe and action_probe measure)
    from collections.abc import Mapping

    from partitioner.calibration.action_probe import ActionProbe
    from runtime.job.link_probe import ProbeOptions, ProbeOutcome

__all__ = ["print_actions", "print_probe", "print_probing", "print_timing_actions"]


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


def print_timing_actions() -> None:
    """Say that the time per action is being measured (a short traced run, seconds)."""
    console(stderr=True).print(
        "timing the runtime's own cost per action (short traced runs: 1f1b, interleaved, zbv) ..."
    )


def print_actions(found: ActionProbe, path: Path, hosting: Mapping[str, ActionProbe] | None = None) -> None:
    """The time per action measured and written into the cluster file at ``path``: one stage a
    rank, and ``hosting``'s schedules (two stages a rank) apart."""
    console().print(
        f"time per action {found.action_s * 1e3:.3f} ms (mean of {found.actions} actions' gaps, median "
        f"{found.median_s * 1e3:.3f} ms) -> {path}'s action_overhead"
    )
    for name, probe in (hosting or {}).items():
        console().print(
            f"time per action under {name}, two stages a rank: {probe.action_s * 1e3:.3f} ms (mean of "
            f"{probe.actions}) -> action_overhead_by_schedule"
        )
