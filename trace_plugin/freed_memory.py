"""Freed memory handed back to the system, where the C library would keep it.

glibc keeps what a process frees in its heap for reuse, and maps apart only allocations
above a threshold that it raises as the process frees large blocks (up to 32 MB). A model
on a CPU allocates and frees tensors of a few MB by the thousand per step (a layer's
activations for a batch, a cache being grown), so after a warm start a trainer stayed at
2.9 GB resident holding 1.1 GB of live memory, and each later phase peaked on top of that.
Fixing the threshold at ``MMAP_THRESHOLD`` maps such tensors apart and unmaps them when
freed; ``trim`` returns what smaller frees left in the heap. Measured in
``docs/performance.md`` (Memory). Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import sys

MMAP_THRESHOLD = 1 << 20  # bytes: every tensor of a MB or more is its own mapping
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - raises AttributeError on another C library
    except (OSError, AttributeError):
        return None
    return libc


@functools.cache
def map_large_blocks() -> bool:
    """Once per process: allocations of ``MMAP_THRESHOLD`` or more are mapped apart, so
    freeing one returns it at once. Whether it took effect."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def trim() -> None:
    """Return the heap's free memory to the system, after a phase that freed much: its
    reference cycles (a trainer and its callbacks) collected first."""
    libc = _glibc()
    if libc is not None:
        gc.collect()
        libc.malloc_trim(0)
