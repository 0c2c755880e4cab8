"""The daemon's C heap: transient buffers of a call stay mapped between calls (glibc only).

Why: a 32768-block Store or Load moves MiB-sized transient buffers through the daemon (the frame
as it arrives, its parse, the packed hashes). glibc serves a buffer above its mmap threshold with a
fresh mmap, and gives the free top of the heap back to the kernel above its trim threshold (both
adapt, up to ~2 MiB apart, so a call's 5 MiB of transients are mapped and unmapped every call);
every page of a fresh mapping is a page fault when first written. On the 2-core CPU box (a VM,
~2-4 us a fault) that was ~460 faults a 32768-block Load, ~1 ms of the call (BENCHMARKS.md, "Lead,
2026-12-07 day"). With both thresholds fixed at TRANSIENT_BYTES the buffers come from the heap and
its free top stays mapped: the faults of a Load fall to ~20.

What it costs: up to TRANSIENT_BYTES of free heap kept mapped per malloc arena (the main thread's,
where the frames are read and parsed, and one per thread that allocates: copy threads, the disk
writers), part of the daemon's fixed overhead over its host tier (tests/test_host_arena.py). It is
applied by `kvservice serve` only (the daemon's own process), never by a library import.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

TRANSIENT_BYTES = 16 << 20  # above the largest frame of max_batch_blocks (32 x 65536 hashes + ids: ~2.4 MiB) x its copies
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_transient_buffers(nbytes: int = TRANSIENT_BYTES) -> bool:
    """Fix glibc's mmap and trim thresholds at nbytes. False (nothing changed) off glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, nbytes) == 1 and mallopt(_M_TRIM_THRESHOLD, nbytes) == 1
    if not ok:
        log.info("mallopt refused the heap thresholds; transient buffers keep glibc's defaults")
    return ok
