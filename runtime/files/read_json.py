"""Read a JSON file, or say in one line why it cannot be read: the library's one JSON reader."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from runtime.errors import RunError

__all__ = ["JsonReadError", "read_json"]


class JsonReadError(RunError):
    """A JSON file that is missing, unreadable or not JSON, with its path and the reason.

    Attributes:
        missing: the file does not exist (a caller may say which command writes it).
    """

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


def read_json(path: str | os.PathLike[str], what: str = "", missing: str | None = None) -> Any:
    """The document in ``path``.

    Args:
        path: the file.
        what: what the file is, for the message (``"the trace"``: "cannot read the trace PATH: ...").
        missing: the message where the file does not exist (default: the generic one).

    Raises:
        JsonReadError: the file is missing, unreadable or not valid JSON.
    """
    file = Path(path)
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        text = missing or f"cannot read {what + ' ' if what else ''}{file}: it does not exist"
        raise JsonReadError(text, missing=True) from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise JsonReadError(f"cannot read {what + ' ' if what else ''}{file}: {exc}") from exc
