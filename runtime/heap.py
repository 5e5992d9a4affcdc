"""Give freed large blocks back to the system at once (glibc), for processes that hold one part of a
model at a time.

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

__all__ = ["map_large_blocks"]

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
