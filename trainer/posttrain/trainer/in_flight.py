"""Steps dispatched ahead of the device, and the tokens/s of a log window over them.

The loop dispatches a step without waiting for the device: at most IN_FLIGHT steps run
ahead, so the device computes while the host loads the next batch and logs. A window's
rate counts a step's tokens only once the device has finished that step and ends its
time at the same step (when its loss has been read), so every window, the last one too,
holds as many steps' time as steps' tokens.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import jax

# Steps dispatched ahead of the device at most: enough to keep it busy while the host
# prepares the next batch, few enough that queued batches never take real memory.
IN_FLIGHT = 2


class Window:
    """The steps since the last log: the tokens (device scalars) of those the device has
    finished, the steps still queued, and when the window began."""

    def __init__(self, in_flight: int = IN_FLIGHT) -> None:
        self.start, self.tokens = time.monotonic(), []
        self.queued: collections.deque = collections.deque()
        self.in_flight = in_flight

    def queue(self, step: int, loss: Any, tokens: Any) -> None:
        """A step dispatched: waits for the device to finish the step IN_FLIGHT before
        it, whose tokens then count."""
        self.queued.append((step, loss, tokens))
        if len(self.queued) > self.in_flight:
            _, done, counted = self.queued.popleft()
            jax.block_until_ready(done)
            self.tokens.append(counted)

    def close(self, step: int, loss: Any) -> tuple[float, float]:
        """(step's loss, the window's tokens/s) of the window that ends with `step`:
        reading its loss waits for it and every step before it, whose tokens count; steps
        queued after it begin the next window, which starts now."""
        while self.queued and self.queued[0][0] <= step:
            self.tokens.append(self.queued.popleft()[2])
        loss_value = float(loss)
        end = time.monotonic()
        rate = sum(int(t) for t in self.tokens) / max(end - self.start, 1e-9)
        self.start, self.tokens = end, []
        return loss_value, rate


def is_ready(value: Any) -> bool:
    """Whether a step's output is computed (host values always are)."""
    ready = getattr(value, "is_ready", None)
    return bool(ready()) if callable(ready) else True
