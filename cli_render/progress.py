"""Progress of a long command: rich's bar on a terminal, plain timed lines in a log or a pipe."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from cli_render.common import console as make_console

__all__ = ["PhaseLog", "progress"]


def progress(transient: bool) -> Any:
    """rich's progress bar on a terminal; elsewhere (a log, a pipe, CI) a line per phase with the
    elapsed time, since rich draws nothing there until the end."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = make_console(stderr=True)
    if not console.is_terminal:
        return PhaseLog(console)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=console, transient=transient)


class PhaseLog:
    """The part of rich's Progress the commands use, as plain lines: one when the phase (the
    description's first word: tracing, measuring, step) changes, at most one per ``every`` seconds
    within a phase, and the last state at the end, each after the seconds since the start. Nothing
    in the first ``delay`` seconds, nor after an error: a command that fails at once prints only its
    ``error:`` line."""

    PATTERN = r"^ *\d+\.\d s  "  # (the start of each line, for tools that read the output)

    def __init__(self, console: Console, every: float = 10.0, delay: float = 2.0) -> None:
        import time

        self.console, self.every, self.delay, self.clock = console, every, delay, time.monotonic
        self.start = self.last = self.clock()
        self.task: dict[str, Any] = {}
        self.shown: tuple[Any, ...] | None = None
        self.phase = ""

    def __enter__(self) -> PhaseLog:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None:
            self.stop()

    def add_task(self, description: str, total: float | None = None) -> int:
        self.task = {"description": description, "completed": 0, "total": total}
        self._show()
        return 0

    def update(self, task: int, **fields: Any) -> None:
        self.task.update({k: v for k, v in fields.items() if v is not None})
        self._show()

    def stop(self) -> None:
        self._show(final=True)

    def _show(self, final: bool = False) -> None:
        now, text, done, total = (
            self.clock(),
            self.task["description"],
            self.task["completed"],
            self.task["total"],
        )
        phase = text.split(" ", 1)[0]
        due = phase != self.phase or now - self.last >= self.every or final
        if not due or self.shown == (text, done, total) or now - self.start < self.delay:
            return
        self.phase, self.last, self.shown = phase, now, (text, done, total)
        count = f" ({done:g}/{total:g})" if total else ""
        self.console.print(f"{now - self.start:7.1f} s  {text}{count}", markup=False, highlight=False)
