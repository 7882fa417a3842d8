"""XLA's CPU settings for the trainer process, set before JAX starts its CPU backend.

XLA's default CPU scheduler orders a step for concurrency: it computes a rematerialised
layer's recomputation as early as it can, so a step with spec.training.remat: layer (or
block) holds what it would hold without remat. The memory-minimising scheduler waits for
the backward pass, as an accelerator's does, so remat saves host memory on CPU too
(tests/trainer/test_capacity_xla.py compiles the rematerialised steps with it; the CPU
examples' measured peaks are in docs/user-guide.md, "Running locally"). Only XLA's CPU
backend reads it; a setting of the flag already in XLA_FLAGS wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SCHEDULER_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"
MEMORY_SCHEDULER = f"--{SCHEDULER_FLAG}=false"


def apply(environ: MutableMapping[str, str] = os.environ) -> str:
    """Adds MEMORY_SCHEDULER to XLA_FLAGS unless they set the scheduler; returns them."""
    flags = environ.get("XLA_FLAGS", "")
    if SCHEDULER_FLAG not in flags:
        flags = f"{flags} {MEMORY_SCHEDULER}".strip()
        environ["XLA_FLAGS"] = flags
    return flags
