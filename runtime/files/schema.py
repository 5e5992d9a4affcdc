"""Check a JSON document against a small schema before anything reads it: one message naming the field.

pipeplan's files (profile.json, plan.json, mp_conf.json, metrics.json) are read by code that trusts
their types: a node's ``inputs`` given as a string would be read letter by letter, an infinite byte
count would overflow ``int()``, a microbatch count of 0 would be replaced by a default. Each reader
checks its document against a schema first, so a malformed file is refused in one line that names the
file, the field's path and what was expected (``plan.json: stages[1].replicas must be an integer >= 1,
got 0``), and nothing downstream sees it. Pure Python: the partitioner's torch-free modules use it too.

Example:
    >>> PLAN_STAGE = Obj({"index": Int(0), "ranks": List(Int(0))})
    >>> check({"index": 0, "ranks": [0, "1"]}, PLAN_STAGE, "plan.json")
    Traceback (most recent call last):
    ...
    runtime.files.schema.SchemaError: plan.json: ranks[1] must be an integer >= 0, got '1'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AnyValue", "Bool", "Int", "List", "Map", "Num", "Obj", "Opt", "SchemaError", "Str", "check"]


class SchemaError(ValueError):
    """A document that does not match its schema; the message names the file and the field."""


class _Schema:
    """One node of a schema: ``check`` raises SchemaError for a value that does not match."""

    def check(self, value: Any, path: str) -> None:
        raise NotImplementedError

    def fail(self, value: Any, path: str, expected: str) -> SchemaError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        return SchemaError(f"{path or 'the document'} must be {expected}, got {shown}")


@dataclass(frozen=True)
class AnyValue(_Schema):
    """Anything (free-form fields such as ``extra``)."""

    def check(self, value: Any, path: str) -> None:
        return None


@dataclass(frozen=True)
class Str(_Schema):
    """A string, optionally one of ``choices``."""

    choices: tuple[str, ...] = ()

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, str):
            raise self.fail(value, path, "a string")
        if self.choices and value not in self.choices:
            raise self.fail(value, path, f"one of {', '.join(self.choices)}")


@dataclass(frozen=True)
class Bool(_Schema):
    """true or false (a string "false" is no boolean)."""

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, bool):
            raise self.fail(value, path, "true or false")


@dataclass(frozen=True)
class Int(_Schema):
    """An integer >= ``low`` (a float with an integer value, as JSON writers may produce, passes)."""

    low: int = 0

    def check(self, value: Any, path: str) -> None:
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not whole or value < self.low:
            raise self.fail(value, path, f"an integer >= {self.low}")


@dataclass(frozen=True)
class Num(_Schema):
    """A finite number >= ``low`` (> ``low`` when ``strict``)."""

    low: float = 0.0
    strict: bool = False

    def check(self, value: Any, path: str) -> None:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value < self.low or (self.strict and value == self.low):
            relation = ">" if self.strict else ">="
            raise self.fail(value, path, f"a finite number {relation} {self.low:g}")


@dataclass(frozen=True)
class Opt(_Schema):
    """``inner`` or null."""

    inner: _Schema

    def check(self, value: Any, path: str) -> None:
        if value is not None:
            self.inner.check(value, path)


@dataclass(frozen=True)
class List(_Schema):
    """A list of ``item``, at least ``min_len`` long (exactly ``length`` when given)."""

    item: _Schema
    min_len: int = 0
    length: int | None = None

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, (list, tuple)):  # (documents built in memory hold tuples)
            raise self.fail(value, path, "a list")
        if len(value) < self.min_len or (self.length is not None and len(value) != self.length):
            size = f"exactly {self.length}" if self.length is not None else f"at least {self.min_len}"
            raise self.fail(value, path, f"a list of {size} items")
        for i, item in enumerate(value):
            self.item.check(item, f"{path}[{i}]")


@dataclass(frozen=True)
class Map(_Schema):
    """An object whose keys are free and whose values are all ``value``."""

    value: _Schema

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, Mapping):
            raise self.fail(value, path, "an object")
        for key, item in value.items():
            self.value.check(item, f"{path}.{key}")


@dataclass(frozen=True)
class Obj(_Schema):
    """An object with ``required`` fields and ``optional`` ones (others are free: files gain fields)."""

    required: Mapping[str, _Schema]
    optional: Mapping[str, _Schema] = field(default_factory=dict)

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, Mapping):
            raise self.fail(value, path, "an object")
        for key, schema in self.required.items():
            if key not in value:
                raise SchemaError(f"{_join(path, key)} is missing")
            schema.check(value[key], _join(path, key))
        for key, schema in self.optional.items():
            if key in value:
                schema.check(value[key], _join(path, key))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def check(doc: Any, schema: _Schema, source: str) -> None:
    """Raise SchemaError, its message starting with ``source``, where ``doc`` does not match ``schema``."""
    try:
        schema.check(doc, "")
    except SchemaError as exc:
        raise SchemaError(f"{source}: {exc}") from None
