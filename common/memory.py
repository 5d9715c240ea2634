"""Giving memory back after a spike: Python frees its own small-object arenas when they empty,
but glibc's malloc keeps the pages it got for large and medium blocks (prompt token lists,
message buffers, libzmq's queues) in its heap until told to trim. `trim()` tells it; the
router calls it when it falls idle after load (services/router/service.py), so that RSS after
a burst comes back near its level before it (docs/benchmarks/stranded.md has the figures)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

_libc: ctypes.CDLL | bool | None = False  # False: not looked up yet; None: no glibc here


def rss_bytes() -> int:
    """This process's resident set size (Linux), or 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def trim() -> bool:
    """Collect cyclic garbage, then return the free pages of malloc's heap to the OS (glibc's
    malloc_trim(0)). False where there is no glibc (musl, macOS): nothing to do there."""
    global _libc
    if _libc is False:
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
            _libc = lib if lib is not None and hasattr(lib, "malloc_trim") else None
        except OSError:
            _libc = None
    gc.collect()
    if not _libc:
        return False
    _libc.malloc_trim(0)  # type: ignore[union-attr]
    return True
