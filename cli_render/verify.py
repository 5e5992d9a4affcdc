"""``pipeplan verify``'s output: one row per stage, then the verdict."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from cli_render.common import console, new_table, plural, tail

__all__ = ["print_verify", "verify_progress", "verify_table"]


@contextmanager
def verify_progress(folder: Any) -> Iterator[Callable[[str, int, int], None]]:
    """A progress callback for :func:`partitioner.verification.verify.verify_package`, shown on stderr while
    the block runs (a bar on a terminal, a timed line per phase in a log: vgg16's check takes 20 s of CPU)."""
    from cli_render.progress import progress

    with progress(transient=True) as bar:
        task = bar.add_task(f"verifying {folder}", total=None)

        def step(what: str, done: int, total: int) -> None:
            bar.update(task, description=what, completed=done, total=total)

        yield step


def print_verify(reports: Sequence[Any]) -> Any:
    """Print the checks (one per microbatch size, the plan's last); returns the report shown: the
    first that failed, else the last."""
    for split in reports[:-1]:
        verdict = "[green]match[/green]" if split.ok else "[red]MISMATCH[/red]"
        console().print(f"{verdict} at the microbatch size {split.batch_size} (what each rank runs)")
    report = next((r for r in reports if not r.ok), reports[-1])
    console().print(verify_table(report))
    for tie in report.ties:
        console().print(f"tied: {tie} (gradients compared as their sum)")
    verdict = "[green]match[/green]" if report.ok else "[red]MISMATCH[/red]"
    console().print(  # the numbers, then the verdict as the last line (what a script reads)
        f"loss {report.loss:.6g} (|diff| {report.loss_error:.2e}), output max |diff| "
        f"{report.output_error:.2e}; tolerance rtol={report.rtol:g} atol={report.atol:g}"
    )
    console().print(
        f"{verdict}: {report.model}, {plural(len(report.stages), 'stage')}, batch {report.batch_size}, "
        f"seed {report.seed}",
        soft_wrap=True,  # one line even with a long model name: scripts read the verdict there
    )
    return report


def verify_table(report: Any) -> Any:
    cols = ("stage", "params", "reads", "returns", "init max\n|diff|", "grad max\n|diff|", "ok")
    table = new_table(f"pipeplan verify {report.package}", cols, ("stage", "reads", "returns", "ok"))
    for s in report.stages:
        table.add_row(
            str(s.index), f"{s.params / 1e6:,.2f}M", "\n".join(tail(n, 16) for n in s.in_names),
            "\n".join(tail(n, 16) for n in s.out_names),
            f"{s.init_error:.2e}", f"{s.grad_error:.2e}", "[green]yes[/green]" if s.ok else "[red]NO[/red]",
        )  # fmt: skip
    return table
