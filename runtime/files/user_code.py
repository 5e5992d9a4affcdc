"""Import a user's Python file by its path: the one importer of every ``file.py:name`` spec (a model's
factory, its example inputs and loss, ``--data``), so a bad file reads the same wherever it is named.

It needs only the standard library and ``runtime.errors``: a generated package's ``_stagekit.py``
calls it on a cluster node that has torch and ``runtime`` but not ``partitioner``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from runtime.errors import RunError

__all__ = ["UserFileError", "check_file", "file_attr", "import_file"]


class UserFileError(RunError):
    """A user's Python file that is missing, does not import, or lacks the name asked for."""


def check_file(where: str | Path, what: str = "file") -> Path:
    """``where`` as an absolute path, once it names a file.

    Raises:
        UserFileError: it names no file (``what`` says which option or spec named it).
    """
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        relative = "" if Path(where).expanduser().is_absolute() else f" (relative to {Path.cwd()})"
        raise UserFileError(f"{what} {where} does not exist; check the path{relative}")
    return path


def import_file(where: str | Path, what: str = "file") -> ModuleType:
    """The module of the Python file ``where``, imported once per process under a name private to its
    path (every caller gets the same module, so its classes are the same classes). Its folder joins
    ``sys.path``: the file may import modules beside it, as ``python file.py`` can.

    Raises:
        UserFileError: the file does not exist, is not Python, or importing it raised (a syntax
            error names its line).
    """
    path = check_file(where, what)
    name = "pipeplan_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserFileError(f"{what} {where} is not a Python file; name a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[name]
        raise UserFileError(f"{what} {where} line {exc.lineno}: {exc.msg}; fix the file") from exc
    except Exception as exc:
        del sys.modules[name]
        raise UserFileError(
            f"importing {what} {where} raised {type(exc).__name__}: {exc}; fix the file"
        ) from exc
    return module


def file_attr(where: str | Path, name: str, what: str = "file") -> Any:
    """``name`` as the Python file ``where`` defines it (:func:`import_file`).

    Raises:
        UserFileError: as :func:`import_file`, or the file defines no ``name`` (the message lists
            the functions it does define).
    """
    module = import_file(where, what)
    if not hasattr(module, name):
        own = {k for k, v in vars(module).items() if getattr(v, "__module__", None) == module.__name__}
        defined = sorted(k for k in own if callable(getattr(module, k)))
        listed = f"; it defines {', '.join(defined)}" if defined else ""
        raise UserFileError(f"{what} {where} defines no {name!r}{listed}; define it or name another")
    return getattr(module, name)
