"""The TPU tier: checks that need a TPU (numerics against the CPU, every technique through
`posttrain run`), run on the chip with `pytest tests/tpu` (docs/tpu.md says how) and
skipped, with the reason, wherever JAX finds no TPU (CI has none). What can be checked
without a chip (programs compiled for a TPU topology with libtpu's compile-only client)
lives in tests/trainer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))  # tiny_model & co


def pytest_collection_modifyitems(config, items):
    import jax

    backend = jax.default_backend()
    if backend == "tpu":
        return
    skip = pytest.mark.skip(reason=f"needs a TPU; JAX's backend here is {backend}")
    for item in items:
        item.add_marker(skip)
