"""Memory settings for long-running commands: start-up's objects out of the cyclic garbage collector's reach,
and (for the aggregator's processes) freed memory kept by malloc for the next message.

A process that imported torch and the kit holds about 330,000 objects the collector tracks, and each full
collection walks all of them. An aggregator's stream of updates leaves enough survivors (each client's round
metrics, receipts, the round's bookkeeping) to set one off every few hundred updates, so a worker would spend a
fair share of its CPU in the collector. Frozen objects are
never collected, so only what start-up built and keeps for good belongs there: call `freeze_startup` once a
command is set up, just before its loop.
"""

from __future__ import annotations

import ctypes
import gc


def freeze_startup() -> None:
    """Collect start-up's garbage, then move every object still alive to the permanent generation."""
    gc.collect()
    gc.freeze()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEEP_FREED_BYTES = 1 << 30  # free memory at the top of a heap this large before glibc gives it back
LARGEST_FROM_HEAP = 32 << 20  # allocations up to this come from malloc's heaps, not fresh mmaps (glibc's maximum)


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the kernel, for a process
    that receives a stream of updates: each message's buffer (hundreds of KiB to tens of MiB) would be a fresh mmap, or
    heap memory trimmed after the previous one was freed, so the kernel's copy into it would take a page fault per
    page. The process keeps its peak
    heap. False where the C library is not glibc (nothing changed)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES)) and bool(mallopt(_M_MMAP_THRESHOLD, LARGEST_FROM_HEAP))
