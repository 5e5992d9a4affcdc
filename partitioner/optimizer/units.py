"""Parse the sizes, rates and delays users type: ``10GB/s``, ``100Gbit/s``, ``1e9``, ``16GiB``, ``5us``."""

from __future__ import annotations

import re

from partitioner.errors import PlanError

__all__ = ["parse_bandwidth", "parse_bytes", "parse_int_list", "parse_latency"]

_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")
_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def _split(text: str, what: str) -> tuple[float, str]:
    match = _NUMBER.match(text)
    if not match:
        raise PlanError(f"bad {what} {text!r}: give a number with an optional unit, e.g. 10GB/s or 16GiB")
    return float(match[1]), match[2]


def parse_bytes(text: str) -> int:
    """``16GiB`` -> 17179869184; ``16GB`` -> 16e9; a bare number is bytes."""
    value, unit = _split(text, "memory size")
    unit = unit.lower().removesuffix("b")
    if unit not in _PREFIX:
        raise PlanError(f"bad memory size {text!r}: use B, KB, MB, GB, KiB, MiB, GiB or TiB")
    size = value * _PREFIX[unit]
    if size <= 0:
        raise PlanError(f"memory must be > 0, got {text!r}")
    return round(size)


def parse_bandwidth(text: str) -> float:
    """Bytes per second from ``1e9``, ``10GB/s``, ``100Gbit/s`` (bits are divided by 8)."""
    value, unit = _split(text, "bandwidth")
    unit = unit.lower().removesuffix("/s").removesuffix("ps")
    bits = False
    if unit.endswith("bit"):
        unit, bits = unit.removesuffix("bit"), True
    else:
        unit = unit.removesuffix("b")
    if unit not in _PREFIX:
        raise PlanError(f"bad bandwidth {text!r}: use e.g. 1e9, 10GB/s or 100Gbit/s")
    rate = value * _PREFIX[unit] / (8 if bits else 1)
    if rate <= 0:
        raise PlanError(f"bandwidth must be > 0 bytes/s, got {text!r}")
    return rate


_PER_SECOND = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}  # 5us = 5 / 1e6 exactly


def parse_latency(text: str) -> float:
    """Seconds from ``5us``, ``1.7ms``, ``0`` or ``2e-3`` (a bare number is seconds)."""
    match = re.match(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(s|ms|us|µs|ns)?\s*$", text)
    if not match:
        raise PlanError(f"bad latency {text!r}: use e.g. 5us, 1.7ms or 0 (a bare number is seconds)")
    return float(match[1]) / _PER_SECOND[match[2] or ""]


def parse_int_list(text: str, what: str) -> list[int]:
    """``4,4`` -> [4, 4]; PlanError names the option when a part is not a positive integer."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise PlanError(f"bad {what} {text!r}: give positive integers separated by commas, e.g. 4,4")
    return values
