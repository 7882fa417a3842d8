"""What the trainer benchmarks time with: ``timed(batches)``.

A training loop, ours or Tunix's, takes its batches from ``timed(batches)``, which notes
the time just before each one is taken; ``seconds(result)`` waits for ``result`` and
gives the time from taking the second batch, so the first step, which compiles, is left
out of every measurement alike.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import jax

T = TypeVar("T")


class timed(Iterable[T]):  # lower case: it reads as a call, `for b in timed(batches)`
    def __init__(self, batches: Iterable[T]) -> None:
        self.batches = batches
        self.stamps: list[float] = []

    def __iter__(self) -> Iterator[T]:
        batches = iter(self.batches)
        while True:
            self.stamps.append(time.perf_counter())
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch

    def seconds(self, result: Any) -> float:
        """Seconds from taking the second batch until ``result`` is computed."""
        jax.block_until_ready(result)
        return time.perf_counter() - self.stamps[1]
