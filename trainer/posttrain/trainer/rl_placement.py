"""Where GRPO's sampler runs (spec.grpo.rollout) and how far ahead it samples
(spec.grpo.maxStaleness).

Disaggregated placement splits ``jax.devices()`` into a trainer mesh and a sampler mesh:
disjoint devices of one program (one process here; under Pathways one controller sees
every device of every host, the programming model this reproduces with 8 CPU devices).
Tunix's ``RLCluster`` takes the sampler mesh as its rollout role's mesh
(``role_to_mesh``): it reshards a copy of the policy onto it once, and its rollout's
``update_params`` takes the policy's trainable params (only the adapters under LoRA).

``AsyncRollouts`` runs the sampler on a thread, ahead of the learner. The rollout of step
j is sampled by the policy of version (updates applied)

    version(j) = max(resumed_step, checkpoint_step(j), j - maxStaleness)

where checkpoint_step(j) is the last multiple of checkpoint.everySteps at or before j.
Every rollout carries its version and the learner refuses one more than maxStaleness
versions old. The version is a function of the step alone, and each rollout's random key
of (seed, step, host), so in-flight rollouts are not checkpointed: a run resumed from a
checkpoint regenerates them with the very weights the uninterrupted run used (the
pipeline restarts on-policy at every checkpoint step in both runs; it costs a drain every
everySteps steps).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from posttrain.api import rollout_split
from posttrain.trainer import mesh as mesh_lib

log = logging.getLogger("posttrain.grpo")


def split_devices(spec: Any, devices: list[Any] | None = None) -> tuple[list[Any], list[Any]]:
    """(trainer devices, sampler devices) of spec.grpo.rollout; every device and [] when
    the sampler is colocated. A split these devices cannot make raises ValueError naming
    the field."""
    devices = list(jax.devices() if devices is None else devices)
    found, problem = rollout_split.split(spec, len(devices))
    if problem:
        field, message = problem
        raise ValueError(f"{field}: {message}")
    if found is None:
        return devices, []
    if found.sampler_slices:
        groups = mesh_lib.slices(devices, None, jax.process_count())
        if len(groups) != spec.resources.slices:
            raise ValueError(
                f"spec.grpo.rollout.samplerSlices: the job has {len(groups)} slices, "
                f"resources.slices says {spec.resources.slices}"
            )
        cut = len(groups) - found.sampler_slices
        return [d for g in groups[:cut] for d in g], [d for g in groups[cut:] for d in g]
    return devices[: found.trainer_devices], devices[found.trainer_devices :]


def describe(spec: Any, devices: int) -> str:
    found, _ = rollout_split.split(spec, devices)
    return found.describe() if found else "colocated"


def devices_of(tree: Any) -> set[Any]:
    """Every device any array of `tree` lives on."""
    return {d for x in jax.tree.leaves(tree) if hasattr(x, "devices") for d in x.devices()}


class Lookahead:
    """A data loader the sampler can read ahead of the training loop: ``peek(m)`` is the
    batch m steps after the one ``next`` returned last. ``get_state`` is the position of
    the loop (batches peeked but not yet taken are read again after a resume)."""

    def __init__(self, loader: Any):
        self.loader = loader
        self.buffer: deque[tuple[Any, Any]] = deque()  # (state before the batch, batch)

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        if self.buffer:
            return self.buffer.popleft()[1]
        return next(self.loader)

    def peek(self, ahead: int) -> Any:
        while len(self.buffer) < ahead:
            state = self.loader.get_state()
            self.buffer.append((state, next(self.loader)))
        return self.buffer[ahead - 1][1]

    def get_state(self) -> Any:
        return self.buffer[0][0] if self.buffer else self.loader.get_state()

    def set_state(self, state: Any) -> None:
        self.buffer.clear()
        self.loader.set_state(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class AsyncRollouts:
    """Rollouts generated on a sampler thread, at most `max_staleness` policy versions
    behind the learner (see the module docstring for the version of each step).

    `snapshot()` (called on the learner's thread when a new version exists) copies the
    trainable params onto the sampler's devices; `generate(step, batch, snapshot)` (on the
    sampler thread, under `lock`) loads them into the sampler and samples."""

    def __init__(
        self,
        *,
        max_staleness: int,
        every_steps: int,
        total_steps: int,
        snapshot: Callable[[], Any],
        generate: Callable[[int, Any, Any], dict[str, np.ndarray]],
        lock: threading.Lock,
    ):
        self.k, self.every, self.total = max_staleness, every_steps, total_steps
        self.snapshot, self.generate, self.lock = snapshot, generate, lock
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sampler")
        self.pending: dict[int, tuple[int, concurrent.futures.Future]] = {}
        self.start: int | None = None
        self.next = 0
        self.clock_start = 0.0
        self.sampler_seconds = self.learner_seconds = self.wait_seconds = 0.0
        self.sync_seconds = 0.0
        self.intervals: dict[str, list[tuple[float, float]]] = {"rollout": [], "train": []}

    def version(self, step: int) -> int:
        """The policy version (updates applied) that samples the rollout of `step`."""
        assert self.start is not None
        checkpoint = step // self.every * self.every
        return max(self.start, checkpoint, step - self.k)

    def submit_due(self, version: int, batch_at: Callable[[int], Any]) -> None:
        """With the policy at `version`: start every rollout that version samples."""
        snap = None
        while self.next < self.total and self.version(self.next) == version:
            if snap is None:
                start = time.monotonic()
                snap = self.snapshot()
                jax.block_until_ready(snap)
                self.sync_seconds = time.monotonic() - start
            step = self.next
            future = self.pool.submit(self._work, step, batch_at(step), snap)
            self.pending[step] = (version, future)
            self.next += 1
        if self.next < self.total and self.version(self.next) < version:
            raise AssertionError(f"the rollout of step {self.next} missed its version")

    def _work(self, step: int, batch: Any, snap: Any) -> dict[str, np.ndarray]:
        with self.lock:
            start = time.monotonic()
            out = self.generate(step, batch, snap)
            end = time.monotonic()
        self.sampler_seconds += end - start
        self.intervals["rollout"].append((start, end))
        return out

    def begin(self, step: int, batch_at: Callable[[int], Any]) -> None:
        """The first call of this attempt, at `step` (0 or the resumed step)."""
        self.start = self.next = step
        self.clock_start = time.monotonic()
        self.submit_due(step, batch_at)

    def take(self, step: int) -> tuple[dict[str, np.ndarray], int]:
        """The rollout of `step` and the version that sampled it (waits for it)."""
        version, future = self.pending.pop(step)
        start = time.monotonic()
        rolled = future.result()
        self.wait_seconds += time.monotonic() - start
        staleness = step - version
        if not 0 <= staleness <= self.k:
            raise AssertionError(
                f"the rollout of step {step} is {staleness} versions old; "
                f"spec.grpo.maxStaleness is {self.k}"
            )
        return rolled, version

    def trained(self, start: float, end: float) -> None:
        self.learner_seconds += end - start
        self.intervals["train"].append((start, end))

    def metrics(self) -> dict[str, float]:
        wall = max(time.monotonic() - self.clock_start, 1e-9)
        return {
            "sampler_busy": self.sampler_seconds / wall,
            "learner_busy": self.learner_seconds / wall,
            "learner_wait_seconds": self.wait_seconds,
            "weight_sync_seconds": self.sync_seconds,  # the last sync
        }

    def close(self) -> None:
        for _, future in self.pending.values():
            future.cancel()
        self.pool.shutdown(wait=True)


def overlapping(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds during which an interval of `a` and one of `b` both ran."""
    return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)
