"""The ``pipeplan`` command: profile -> partition -> verify -> run.

Commands stay thin: parse options, call the library, render with rich. This is the only module that
uses rich, and it imports torch and the heavy library modules lazily, inside the commands, so
``pipeplan --help`` stays fast.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.console import Console

__all__ = ["main"]

F = TypeVar("F", bound=Callable[..., Any])


def _console(stderr: bool = False) -> Console:
    """One Console per stream; commands print tables on stdout and progress/errors on stderr."""
    return Console(stderr=stderr, highlight=False)


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
            _console(stderr=True).print(f"[red]error:[/red] {exc}", soft_wrap=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug logs).")
@click.version_option(package_name="pipeplan")
def main(debug: bool, verbose: int) -> None:
    """Automatic pipeline-parallel training for PyTorch.

    \b
    The workflow, each step writing a file the next one reads:
      pipeplan profile vgg16          measure every layer       -> profiles/vgg16/profile.json
      pipeplan partition --gpus 4     choose stages + replicas  -> models/vgg16/gpus=4/
      pipeplan verify                 check the stages against the original model
      pipeplan run                    train the package on its ranks (torchrun)
    """
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


# ----------------------------------------------------------------------------- profile
# (owned by the profiler: partitioner/profiler, partitioner/models.py)


# ----------------------------------------------------------------------------- partition
# (owned by the optimizer: partitioner/optimizer, partitioner/codegen.py)


# ----------------------------------------------------------------------------- verify
# (owned by code generation: partitioner/codegen.py, partitioner/verify.py)


# ----------------------------------------------------------------------------- run
# (owned by the runtime: runtime/)


if __name__ == "__main__":
    main()
