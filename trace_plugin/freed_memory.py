"""Freed memory handed back to the system, where the C library would keep it.

glibc keeps what a process frees in its heap for reuse. A process that serves and trains a
model on a CPU frees gigabytes between its phases (an evaluation's key/value caches, a warm
start's activations), and the next phase peaks on top of what the heap kept: a trainer
stayed at 2.9 GB resident after its warm start, holding 1.1 GB of live memory. ``trim``
returns that memory between phases. Mapping every tensor of a MB or more apart instead
(glibc's ``M_MMAP_THRESHOLD``) kept peaks lower still, but made a training step 26% slower
(page faults on every fresh tensor), so it is not done. Elsewhere than glibc ``trim``
does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import sys


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


def trim(*, collect: bool = True) -> None:
    """Return the heap's free memory to the system, after a phase that freed much: its
    reference cycles (a trainer and its callbacks) collected first, unless ``collect`` is
    off (a serving loop trims often and holds no such cycles)."""
    libc = _glibc()
    if libc is not None:
        if collect:
            gc.collect()
        libc.malloc_trim(0)
