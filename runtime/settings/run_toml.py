"""``run.toml``: every option of a run in one file, read by ``pipeplan run --config`` and written back
into the run folder, so a run can be repeated exactly.

Keys are the options of ``pipeplan run`` (``steps``, ``lr``, ``checkpoint-every`` or
``checkpoint_every``), plus ``package``; flags given on the command line win over the file. The file
written into the run folder holds every option of the run as it started (defaults included), so
``pipeplan run --config PKG/run/run.toml`` trains the same run again.

Example:
    >>> read_config("run.toml", ["steps", "lr"])  # doctest: +SKIP
    {'steps': 100, 'lr': 0.0003}
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from runtime.errors import RunError
from runtime.settings.run_options import RunOptions, flat_fields

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["CONFIG_NAME", "read_config", "to_toml", "write_config"]

CONFIG_NAME = "run.toml"
_INTERNAL = {"launcher_pid", "resume_step", "start_method"}
"""Fields the launcher sets for its ranks (or the library's callers only), not options of ``pipeplan run``."""


def read_config(path: str | Path, known: Iterable[str]) -> dict[str, Any]:
    """The options of ``path`` by name (dashes read as underscores); lists become comma-separated
    text, as the command line takes them (``betas = [0.9, 0.95]``).

    Raises:
        RunError: an unreadable file, TOML that does not parse, a table, or a key that is no option.
    """
    file = Path(path)
    try:
        doc = tomllib.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RunError(f"--config {file}: cannot read it: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise RunError(f"--config {file}: not TOML: {exc}") from exc
    names = set(known)
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = key.replace("-", "_")
        if name not in names:
            shown = ", ".join(sorted(n.replace("_", "-") for n in names))
            raise RunError(
                f"--config {file}: unknown key {key!r}; the keys are the options of `pipeplan run`: {shown}"
            )
        if isinstance(value, dict):
            raise RunError(f"--config {file}: {key} is a table; give it as {key} = value")
        out[name] = ",".join(map(str, value)) if isinstance(value, list) else value
    return out


def _value(value: Any) -> str:
    """A TOML value: strings quoted (JSON's escapes are TOML's basic-string escapes), floats that read
    back as floats, tuples as arrays."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "inf" if value > 0 else "-inf" if value < 0 else "nan"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return json.dumps(str(value))


def to_toml(options: RunOptions) -> str:
    """Every option of ``options`` (None ones left out: they are the defaults) as TOML."""
    lines = ["# pipeplan run --config run.toml repeats this run; flags on the command line win."]
    # a repeat is a new run: its folder, and the checkpoints inside it, are its own
    own = {"run_dir"} | ({"checkpoint_dir"} if _inside_run(options) else set())
    for f, value in flat_fields(options):
        if f.name not in _INTERNAL and f.name not in own and value is not None:
            lines.append(f"{f.name.replace('_', '-')} = {_value(value)}")
    return "\n".join(lines) + "\n"


def _inside_run(options: RunOptions) -> bool:
    """Whether the checkpoints go into the run's own folder (the default)."""
    if options.run_dir is None or options.checkpoint_dir is None:
        return False
    return Path(options.checkpoint_dir).resolve() == (Path(options.run_dir) / "checkpoints").resolve()


def write_config(folder: Path, options: RunOptions) -> Path:
    """Write ``run.toml`` into ``folder`` (through a temporary file and a rename)."""
    folder.mkdir(parents=True, exist_ok=True)
    path, tmp = folder / CONFIG_NAME, folder / f".{CONFIG_NAME}.tmp"
    tmp.write_text(to_toml(options), encoding="utf-8")
    tmp.replace(path)
    return path
