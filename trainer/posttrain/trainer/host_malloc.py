"""glibc malloc settings for the trainer process: freed memory goes back to the system.

On CPU the trainer's arrays live in the process heap. glibc serves allocations below its
mmap threshold from its arenas and raises that threshold (up to 32 MiB) each time a larger
mmapped block is freed, so after the first step a step's activation-sized buffers come
from the arenas, and what they free mostly stays with the process: the resting size grows
step after step and each step's buffers come on top. A fixed 1 MiB threshold (mmapped
blocks go back to the system when freed) and trimming the heap above 1 MiB keep the
resting size flat: about 0.5 GiB less at the DPO example's peak, at the same speed
(docs/user-guide.md, "Running locally").

glibc also gives each new thread an arena of its own, up to eight per core, and XLA's
thread pool, Grain's prefetch threads and Orbax's writers all allocate: each arena keeps
its own freed small blocks, so the resting size crept up by about 0.7 GiB over the
distillation example's 60 steps (peaks of 4.0-4.6 GiB). Two arenas keep it flat (3.5 GiB
at its peak). ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or
``MALLOC_ARENA_MAX`` set by the user win; elsewhere than glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

THRESHOLD = 1 << 20
ARENAS = 2
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_USER_SETTINGS = {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX"}


def return_freed_memory(threshold: int = THRESHOLD) -> bool:
    """Fix glibc's mmap and trim thresholds at `threshold` bytes and its arenas at
    `ARENAS` (call it before the process starts threads); False where this is not glibc
    or the user tuned malloc through the environment."""
    if _USER_SETTINGS & set(os.environ):
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    settings = {_M_MMAP_THRESHOLD: threshold, _M_TRIM_THRESHOLD: threshold, _M_ARENA_MAX: ARENAS}
    return all(mallopt(p, value) == 1 for p, value in settings.items())
