"""``pipeplan run``'s output: a progress line fed by the loss-reporting rank while the job trains,
then measured against predicted time (and memory) per rank and stage."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from cli_render.common import console, new_table, plural
from cli_render.progress import progress
from runtime.observing.metrics import cpu_share

__all__ = ["COMM_NOTE", "eval_text", "header", "memory_table", "print_run_table", "stage_table", "train"]

COMM_NOTE = (
    "* measured comm is the time a rank was blocked in receives and all-reduces, waiting for its peer "
    "included; the plan's is its messages' wire time: no ratio (the waiting shows in the bubble)"
)


def train(options: Any) -> None:
    """Launch with a progress bar fed by the loss-reporting rank, then print measured vs predicted."""
    from pathlib import Path

    from runtime.datasets.minibatches import SYNTHETIC_STEPS
    from runtime.errors import Interrupted, JobFailed
    from runtime.job.launch import check_launch, launch, resolve_resume
    from runtime.job.run_header import run_header
    from runtime.job.worker import job_of

    per_node = check_launch(options)
    options, notes = resolve_resume(options)
    for note in notes:
        console(stderr=True).print(note, soft_wrap=True, markup=False)
    total = options.steps or (
        (options.epochs or 1) * SYNTHETIC_STEPS if options.data == "synthetic" else None
    )
    console().print(header(run_header(options, job_of(options), per_node, total)))
    with progress(transient=False) as bar:
        task = bar.add_task(f"training {Path(options.package).name}", total=total)

        held_out = ""

        def on_progress(step: int, loss: float, evaluation: dict[str, Any] | None = None) -> None:
            nonlocal held_out
            if evaluation is not None:
                held_out = eval_text(evaluation)
            bar.update(task, completed=step, description=f"step {step} loss {loss:.4f}{held_out}")

        try:
            metrics = launch(options, on_progress, per_node)
        except (JobFailed, Interrupted) as exc:
            bar.stop()
            from rich.markup import escape

            failed = isinstance(exc, JobFailed)
            console(stderr=True).print(
                f"[red]error:[/red] {'training failed: ' if failed else ''}{escape(str(exc))}", soft_wrap=True
            )
            sys.exit(1 if isinstance(exc, JobFailed) else 128 + exc.signum)
    if metrics is not None:
        path = Path(options.run_dir or Path(options.package) / "run") / "metrics.json"
        print_run_table(metrics, path, options.checkpoint_dir)


def header(rows: Sequence[tuple[str, str]]) -> Any:
    """The run's header (:mod:`runtime.header`): label and text, the text wrapped beside the labels."""
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


def print_run_table(metrics: dict[str, Any], path: object, checkpoints: object = None) -> None:
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
    share = cpu_share(metrics)
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
    (:mod:`runtime.fidelity`; ``-``: not predicted or not measured)."""
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
