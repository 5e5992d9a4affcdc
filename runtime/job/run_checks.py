"""A run's settings checked as a whole before any rank starts: the optimizer's settings against the
schedule (an error), and what is legal but worth a note (a precision other than the plan's, a
warm-up as long as the run)."""

from __future__ import annotations

from runtime.job.worker import job_of
from runtime.settings.run_options import RunOptions

__all__ = ["check_run"]


def check_run(options: RunOptions) -> list[str]:
    """Raise RunError for settings no rank could train with; return the notes (each one line)."""
    settings = options.optim
    job = job_of(options)
    settings.check_schedule(job.schedule)
    notes = []
    if job.precision != job.plan_precision:
        notes.append(
            f"training at {job.precision}, but the plan was made for "
            f"{job.plan_precision}: its predicted time and memory are {job.plan_precision}'s (profile and "
            f"partition with --precision {job.precision} for a plan of this run)"
        )
    if options.steps is not None and settings.warmup_steps >= options.steps:
        notes.append(
            f"--warmup-steps {settings.warmup_steps} is not below --steps "
            f"{options.steps}: the learning rate stays below --lr for the whole run"
        )
    return notes
