"""glibc malloc settings for the trainer process: freed memory goes back to the system.

On CPU the trainer's arrays live in the process heap. glibc serves allocations below its
mmap threshold from its arenas and raises that threshold (up to 32 MiB) each time a larger
mmapped block is freed, so after the first step a step's activation-sized buffers come
from the arenas, and what they free mostly stays with the process: the resting size grows
step after step and each step's buffers come on top. A fixed 1 MiB threshold (mmapped
blocks go back to the system when freed) and trimming the heap above 1 MiB keep the
resting size flat: about 0.5 GiB less at the DPO example's peak, at the same speed
(docs/user-guide.md, "Running locally"). ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` set by the user win; elsewhere than glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

THRESHOLD = 1 << 20
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers
_M_MMAP_THRESHOLD = -3


def return_freed_memory(threshold: int = THRESHOLD) -> bool:
    """Fix glibc's mmap and trim thresholds at `threshold` bytes; False where this is not
    glibc or the user tuned them through the environment."""
    if {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ):
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
    return all(mallopt(p, threshold) == 1 for p in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD))
