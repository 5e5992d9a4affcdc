"""The process's memory as the system sees it: its resident size, and freed large blocks given back
at once (glibc), for processes that hold one part of a model at a time.

glibc serves blocks above its mmap threshold with their own mappings, returned when freed, but it
raises that threshold (up to 32 MiB) each time such a block is freed, after which blocks of a few MiB
come from its heap and stay there, resident, when freed: a process that makes and drops weight after
weight (``pipeplan verify``, stage by stage) grows towards the sum of everything it ever held. A fixed
threshold keeps every large block in its own mapping. Other C libraries are left alone.

Example:
    >>> map_large_blocks()  # doctest: +SKIP
    True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import sys

__all__ = ["map_large_blocks", "peak_resident_bytes", "reset_peak", "resident_bytes"]

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def map_large_blocks(threshold: int = 1 << 20) -> bool:
    """Serve every block of at least ``threshold`` bytes with its own mapping; False where the C
    library is not glibc (nothing changed)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


def resident_bytes() -> int | None:
    """The process's resident size now (Linux; None elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_resident_bytes() -> int:
    """The largest resident size the process has had since :func:`reset_peak` (or since it started)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def reset_peak() -> bool:
    """Make the resident size now the peak :func:`peak_resident_bytes` counts from (Linux 4.0 on:
    ``/proc/self/clear_refs``), so an earlier, passing peak (compiling a large module, say) does not
    hide what comes next; False where the system cannot."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True
