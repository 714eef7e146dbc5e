"""Keep ZeroMQ's message buffers mapped (glibc only).

Every received message of ~1 MiB is a fresh ``malloc`` in ZeroMQ's I/O thread and a ``free`` in
the agent's thread. With glibc's defaults, a free at the top of that thread's arena trims it
(``madvise``), so the next message faults its pages in again and the kernel zeroes them: one more
pass over every byte received, measured at about a third more receiver CPU per byte on 2 cores.
The daemons raise the trim and mmap thresholds once at start; a library user's process is left
alone (``AgentThread`` does not call this).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of freed heap mapped: bounded by the messages in flight
MMAP_THRESHOLD = 32 << 20  # messages up to 32 MiB come from the heap, not a fresh mmap each


def keep_message_buffers_mapped() -> bool:
    """Raise glibc's trim and mmap thresholds; False (and nothing changed) where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("no glibc mallopt here: malloc thresholds left as they are")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    log.debug("malloc thresholds: trim %d, mmap %d (%s)", TRIM_THRESHOLD, MMAP_THRESHOLD, "set" if ok else "refused")
    return ok


_trim: Any = None


def trim_freed_heap() -> bool:
    """Give the heap's free pages back to the kernel (glibc ``malloc_trim(0)``): what
    :func:`keep_message_buffers_mapped` keeps for transfers, returned while a daemon is idle, so
    that bursts of short-lived connections (garbage from many identities) do not leave the RSS
    at their high-water mark. False where there is no glibc."""
    global _trim
    if _trim is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _trim = libc.malloc_trim
            _trim.argtypes = [ctypes.c_size_t]
            _trim.restype = ctypes.c_int
        except (OSError, AttributeError):
            _trim = False
    return bool(_trim and _trim(0))
