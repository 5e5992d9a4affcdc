"""Every failure as one ``error:`` line: the library's typed errors (exit 2, a traceback with
--debug), click's usage errors (exit 2) and Ctrl-C (exit 130)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from cli_render.common import console

__all__ = ["OneLineErrors", "user_errors"]

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(func: F) -> F:
    """Turn the library's typed errors into one red line and exit code 2 (a traceback with --debug)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from partitioner.errors import PipeplanError
        from runtime.errors import RunError

        try:
            return func(*args, **kwargs)
        except (PipeplanError, RunError) as exc:
            if click.get_current_context().find_root().params.get("debug"):
                raise
            from rich.markup import escape

            console(stderr=True).print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


class OneLineErrors(click.Group):
    """click's own usage errors (bad option, value out of range) as one ``error:`` line, exit 2, like
    the library's; Ctrl-C as one line and exit 130. click would print a three-line usage block."""

    def main(  # type: ignore[override]
        self, args: Sequence[str] | None = None, prog_name: str | None = None, standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:  # fmt: skip
        if not standalone_mode:
            return super().main(args, prog_name, standalone_mode=False, **extra)
        try:
            result = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            message = exc.format_message().rstrip(".")
            click.echo(f"error: {message[:1].lower()}{message[1:]}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        sys.exit(result if isinstance(result, int) else 0)
