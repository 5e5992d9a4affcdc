"""``pipeplan verify``'s output: one row per stage, then the verdict."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from cli_render.common import console, new_table, plural, tail

__all__ = ["print_verify", "ranks_table", "verify_progress", "verify_table"]


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


def print_verify(reports: Sequence[Any], ranks: Any = None) -> bool:
    """Print the checks (one per microbatch size, the plan's last, then a 3D package's check on its
    ranks); returns whether all of them match. The one-process table shown is the first report
    that failed, else the last."""
    for split in reports[:-1]:
        verdict = "[green]match[/green]" if split.ok else "[red]MISMATCH[/red]"
        console().print(f"{verdict} at the microbatch size {split.batch_size} (what each rank runs)")
    report = next((r for r in reports if not r.ok), reports[-1])
    console().print(verify_table(report))
    for tie in report.ties:
        console().print(f"tied: {tie} (gradients compared as their sum)")
    console().print(  # the numbers, then the verdict as the last line (what a script reads)
        f"loss {report.loss:.6g} (|diff| {report.loss_error:.2e}), output max |diff| "
        f"{report.output_error:.2e}; tolerance rtol={report.rtol:g} atol={report.atol:g}"
    )
    if ranks is not None:
        _print_ranks(ranks)
    ok = all(r.ok for r in reports) and (ranks is None or ranks.ok)
    verdict = "[green]match[/green]" if ok else "[red]MISMATCH[/red]"
    on_ranks = f", on {ranks.world_size} gloo ranks" if ranks is not None else ""
    console().print(
        f"{verdict}: {report.model}, {plural(len(report.stages), 'stage')}, batch {report.batch_size}, "
        f"seed {report.seed}{on_ranks}",
        soft_wrap=True,  # one line even with a long model name: scripts read the verdict there
    )
    return ok


def _print_ranks(ranks: Any) -> None:
    """A 3D package's stages as its ranks ran them: the table, then a line per stage that differs."""
    console().print(ranks_table(ranks))
    for s in ranks.stages:
        if not s.ok:
            worst = max(
                ("weights", s.init_error), ("outputs", s.output_error),
                ("input gradients", s.input_grad_error), ("weight gradients", s.grad_error),
                key=lambda pair: pair[1],
            )  # fmt: skip
            console().print(
                f"[red]MISMATCH[/red] on ranks: stage {s.index} ({s.layout}) on ranks "
                f"{', '.join(map(str, s.failed))}: {worst[0]} max |diff| {worst[1]:.2e}",
                soft_wrap=True,
            )
    console().print(f"each rank's output: {ranks.logs}", soft_wrap=True, markup=False)


def ranks_table(ranks: Any) -> Any:
    """One row per 3D stage: its ranks' shares gathered whole against the plain stage, the worst rank's
    differences (weights, outputs, input and weight gradients)."""
    cols = ("stage", "layout", "ranks", "init\n|diff|", "out\n|diff|", "in grad\n|diff|", "grad\n|diff|",
            "ok")  # fmt: skip
    title = f"on {ranks.world_size} gloo ranks, batch {ranks.batch_size} (each stage's worst rank)"
    table = new_table(title, cols, ("stage", "layout", "ranks", "ok"))
    for s in ranks.stages:
        table.add_row(
            str(s.index), s.layout, _span(s.ranks), f"{s.init_error:.2e}", f"{s.output_error:.2e}",
            f"{s.input_grad_error:.2e}", f"{s.grad_error:.2e}",
            "[green]yes[/green]" if s.ok else "[red]NO[/red]",
        )  # fmt: skip
    return table


def _span(ranks: Sequence[int]) -> str:
    """Ranks as a cell: ``4-7`` when consecutive (a stage's usually are), else listed."""
    consecutive = len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks)))
    return f"{ranks[0]}-{ranks[-1]}" if consecutive else ",".join(map(str, ranks))


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
