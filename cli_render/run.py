"""``pipeplan run``'s output: a progress line fed by the loss-reporting rank while the job trains,
then measured against predicted time (and memory) per rank and stage."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import click

from cli_render.common import console, new_table, plural
from cli_render.progress import progress
from runtime.errors import Interrupted, JobFailed

if TYPE_CHECKING:  # (types only: this module prints, runtime.job.run_job runs the job)
    from runtime.job.run_job import RunOutcome, RunStart

__all__ = [
    "COMM_NOTE", "RunDisplay", "eval_text", "header", "memory_table", "print_run", "print_run_table",
    "stage_table",
]  # fmt: skip

COMM_NOTE = (
    "* measured comm is the time a rank was blocked in receives and all-reduces, waiting for its peer "
    "included; the plan's is its messages' wire time: no ratio (the waiting shows in the bubble)"
)


class RunDisplay:
    """What ``pipeplan run`` shows while its job runs, as :class:`runtime.job.run_job.RunEvents`'
    callbacks: the resume's lines, the header, then a progress bar fed by the loss-reporting rank.
    Used as a context around the job: the bar ends with it, and a failed or interrupted job becomes
    one ``error:`` line and its exit code (1, or 128 + the signal)."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._stack = ExitStack()
        self._task = 0
        self._held_out = ""

    def __enter__(self) -> RunDisplay:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        code = None
        if isinstance(exc, JobFailed | Interrupted):
            if self._bar is not None:
                self._bar.stop()
            from rich.markup import escape

            failed = isinstance(exc, JobFailed)
            console(stderr=True).print(
                f"[red]error:[/red] {'training failed: ' if failed else ''}{escape(str(exc))}", soft_wrap=True
            )
            code = 1 if isinstance(exc, JobFailed) else 128 + exc.signum
        self._stack.__exit__(kind, exc, tb)
        if code is not None:
            sys.exit(code)

    def resume(self, line: str) -> None:
        console(stderr=True).print(line, soft_wrap=True, markup=False)

    def start(self, start: RunStart) -> None:
        """The header on stdout, then the bar on stderr (counting to ``start.total`` steps)."""
        console().print(header(start.header))
        self._bar = self._stack.enter_context(progress(transient=False))
        self._task = self._bar.add_task(f"training {start.package}", total=start.total)

    def progress(self, step: int, loss: float, evaluation: dict[str, Any] | None = None) -> None:
        if evaluation is not None:
            self._held_out = eval_text(evaluation)
        self._bar.update(
            self._task, completed=step, description=f"step {step} loss {loss:.4f}{self._held_out}"
        )


def print_run(done: RunOutcome) -> None:
    """After the job: a dry run's torchrun commands and schedule (as plain lines, never wrapped, to
    copy), else the measured against predicted tables (node 0; other nodes print nothing more)."""
    for line in done.commands:
        click.echo(line)
    for line in done.preview:
        click.echo(f"# {line}")
    if done.metrics is not None:
        print_run_table(done.metrics, done.metrics_path, done.options.checkpoint_dir, done.cpu_share)


def header(rows: Sequence[tuple[str, str]]) -> Any:
    """The run's header (:mod:`runtime.job.run_header`): label and text, the text wrapped beside the
    labels."""
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    for label, text in rows:
        grid.add_row(Text(label), Text(text))
    return grid


def eval_text(evaluation: dict[str, Any]) -> str:
    """`` eval 1.2345 (acc 67.8%)`` for the progress line."""
    accuracy = evaluation.get("accuracy")
    return f" eval {evaluation['loss']:.4f}" + (f" acc {accuracy:.1%}" if accuracy is not None else "")


def print_run_table(
    metrics: dict[str, Any], path: object, checkpoints: object = None, share: float | None = None
) -> None:
    """Measured against predicted: the minibatch time, per stage, per rank, memory; the losses and
    where the files are; a note when the time is far from the plan's (``share``: the share of a core
    the CPU ranks had while computing, :func:`runtime.observing.metrics.cpu_share`, named as a cause)."""

    def ms(value: float | None) -> str:
        return f"{value * 1e3:.2f} ms" if value is not None else "-"

    ratio = metrics.get("ratio_measured_over_predicted")
    micro, ranks_n = metrics["microbatches"], metrics["world_size"]
    title = f"{metrics['schedule']}, {plural(micro, 'microbatch', 'microbatches')}, {plural(ranks_n, 'rank')}"
    table = new_table(title, ("", "measured", "predicted\n(plan.json)", "measured/\npredicted"), ("",))
    table.add_row(
        "time per minibatch",
        ms(metrics["time_per_minibatch_s"]),
        ms(metrics["predicted_time_per_minibatch_s"]),
        f"{ratio:.2f}" if ratio is not None else "-",
    )
    ranks = new_table("per rank (seconds over all steps)", ("rank", "stage", "compute", "comm", "idle"))
    for r in metrics["ranks"]:
        ranks.add_row(
            str(r["rank"]),
            ",".join(map(str, r.get("hosted") or ())) or str(r["stage"]),
            *(f"{r[k]:.3f}" for k in ("compute_s", "comm_s", "idle_s")),
        )
    out = console()
    out.print(table)
    if any("bubble_fraction" in s for s in metrics.get("stages") or ()):
        out.print(stage_table(metrics))
        out.print(COMM_NOTE)
    out.print(ranks)
    if (metrics.get("memory") or {}).get("method"):
        out.print(memory_table(metrics["memory"]))
    losses = metrics["losses"]
    if losses:
        out.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    evals = metrics.get("eval") or []
    if evals:
        steps = ", ".join(f"step {e['step']}{eval_text(e)}" for e in evals)
        out.print(f"held-out: {steps}", soft_wrap=True)
    out.print(f"metrics: {path}")
    if checkpoints is not None:
        out.print(f"checkpoints: {checkpoints} (`pipeplan export -o model.safetensors` reads the newest)")
    if ratio is None or 0.8 <= ratio <= 1.25:
        return
    shared = (
        f"; the ranks had {share:.0%} of a core while computing ({os.cpu_count() or 1} cores for "
        f"{len(metrics['ranks'])} ranks here, other jobs included)"
        if share is not None and share < 0.85
        else ""
    )
    out.print(
        f"[yellow]note:[/yellow] measured/predicted {ratio:.2f}{shared}: `pipeplan calibrate` feeds the "
        "measured stage times back into the profile, so the next `pipeplan partition` plans with them",
    )


def stage_table(metrics: dict[str, Any]) -> Any:
    """Per stage, predicted (plan.json) against measured: compute and communication milliseconds per
    minibatch, the bubble (the share of a device's time not computing) and the memory ratio
    (:mod:`runtime.observing.fidelity`; ``-``: not predicted or not measured)."""
    from cli_render.common import num

    def ms(value: float | None) -> str:
        return num(value * 1e3) if value is not None else "-"

    def share(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    hosted = {r["stage"]: r.get("hosted") or () for r in metrics.get("ranks") or ()}
    memory = {m["stage"]: m for m in (metrics.get("memory") or {}).get("stages") or ()}
    cols = ("stage", "compute ms\npred", "\nmeas", "\nratio", "comm ms\npred", "\nmeas*", "bubble\npred",
            "\nmeas", "memory\nratio")  # fmt: skip
    table = new_table("per stage, per minibatch: predicted (plan.json) and measured", cols)
    for s in metrics["stages"]:
        ratio = s.get("compute_measured_over_predicted")
        mem = (memory.get(s["stage"]) or {}).get("ratio_measured_over_predicted")
        table.add_row(
            ",".join(map(str, hosted.get(s["stage"]) or ())) or str(s["stage"]),
            ms(s.get("predicted_compute_s_per_minibatch")), ms(s["compute_s_per_minibatch"]),
            share(ratio), ms(s.get("predicted_comm_s_per_minibatch")), ms(s.get("comm_s_per_minibatch")),
            share(s.get("predicted_bubble_fraction")), share(s.get("bubble_fraction")), share(mem),
        )  # fmt: skip
    return table


def memory_table(memory: dict[str, Any]) -> Any:
    """Per stage: the peak memory its ranks measured next to the plan's prediction."""
    from partitioner.optimizer.pricing.price import gib

    title = f"peak memory per device ({memory['method']}, first {memory['window_minibatches']} minibatches)"
    table = new_table(title, ("stage", "measured", "predicted\n(plan.json)", "measured/\npredicted"))
    for s in memory["stages"]:
        got, want, ratio = s["measured_peak_bytes"], s["predicted_bytes"], s["ratio_measured_over_predicted"]
        table.add_row(str(s["stage"]), gib(got) if got is not None else "-", gib(want) if want else "-",
                      f"{ratio:.2f}" if ratio is not None else "-")  # fmt: skip
    return table
