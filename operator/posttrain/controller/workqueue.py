"""The queue of jobs to reconcile: each job at most once at a time, retried with backoff.

`add(key)` asks for a reconcile of a job (a watch event about it or its children); a key
already waiting is not queued twice, and one being reconciled runs once more after.
`retry(key, delay)` re-queues after a transient error (throttling, a server error, a
timeout, a conflict), waiting `delay` or, when the errors repeat, twice as long as last
time, up to MAX_BACKOFF; `forget(key)` resets that once a reconcile succeeds. Until a
retry is due, events do not run the key sooner. Urgent keys (jobs whose JobSet is not
made yet) are taken before the rest, and while any wait a reconcile that has just made
a JobSet leaves that job's status for later (`reconcile.apply`).

`start()` runs its workers, `pause()` cancels them at once and forgets every key (a
replica that stops leading acts no more; the one that leads next queues every job).

It runs on kopf's event loop; `work(key)` is a coroutine.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Hashable

log = logging.getLogger("posttrain.operator")
MAX_BACKOFF = 60.0


class WorkQueue:
    def __init__(self, work: Callable[[Hashable], Awaitable[None]], workers: int = 16):
        self.work, self.workers = work, workers
        self._urgent: collections.deque[Hashable] = collections.deque()
        self._normal: collections.deque[Hashable] = collections.deque()
        self._queued: set[Hashable] = set()
        self._running: set[Hashable] = set()
        self._dirty: set[Hashable] = set()
        self._failures: collections.Counter[Hashable] = collections.Counter()
        self._due: dict[Hashable, asyncio.TimerHandle] = {}
        self._later: dict[Hashable, asyncio.TimerHandle] = {}
        self._items = asyncio.Semaphore(0)
        self._tasks: list[asyncio.Task] = []

    @property
    def running(self) -> bool:
        return bool(self._tasks)

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.workers)]

    def pause(self) -> list[asyncio.Task]:
        """Cancel the workers (a reconcile in progress stops at its next await) and
        forget every key, its retries and backoff; the cancelled workers."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for pending in (self._due, self._later):
            for handle in pending.values():
                handle.cancel()
            pending.clear()
        for keys in (self._urgent, self._normal, self._queued, self._dirty, self._failures):
            keys.clear()
        self._running.clear()
        self._items = asyncio.Semaphore(0)
        return tasks

    async def stop(self) -> None:
        await asyncio.gather(*self.pause(), return_exceptions=True)

    def urgent_waiting(self) -> bool:
        """Whether urgent keys wait to be taken (safe to ask from any thread)."""
        return bool(self._urgent)

    def __len__(self) -> int:
        return len(self._queued) + len(self._due)

    def add(self, key: Hashable, urgent: bool = False) -> None:
        if key in self._due:  # a retry is due later: it runs then
            return
        if key in self._running:
            self._dirty.add(key)
            return
        if key in self._queued:
            return
        self._queued.add(key)
        (self._urgent if urgent else self._normal).append(key)
        self._items.release()

    def retry(self, key: Hashable, delay: float, backoff: bool = True) -> None:
        failures = self._failures[key] if backoff else 0
        self._failures[key] += 1
        wait = min(MAX_BACKOFF, delay * 2**failures)
        if key in self._due:
            self._due.pop(key).cancel()
        self._due[key] = asyncio.get_running_loop().call_later(wait, self._due_now, key)

    def later(self, key: Hashable, delay: float) -> None:
        """Run key again in `delay` seconds (something it waits for sends no event); of
        two such times, the earlier."""
        loop = asyncio.get_running_loop()
        if (pending := self._later.get(key)) is not None:
            if pending.when() <= loop.time() + delay:
                return
            pending.cancel()

        def due() -> None:
            self._later.pop(key, None)
            self.add(key)

        self._later[key] = loop.call_later(delay, due)

    def forget(self, key: Hashable) -> None:
        self._failures.pop(key, None)

    def drop(self, key: Hashable) -> None:
        """The job is gone: no retry for it."""
        self._failures.pop(key, None)
        for pending in (self._due, self._later):
            if key in pending:
                pending.pop(key).cancel()

    def _due_now(self, key: Hashable) -> None:
        self._due.pop(key, None)
        self.add(key, urgent=True)

    async def _worker(self) -> None:
        while True:
            await self._items.acquire()
            key = (self._urgent or self._normal).popleft()
            self._queued.discard(key)
            self._running.add(key)
            try:
                await self.work(key)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop the worker; retried with backoff
                log.exception("reconciling %s failed", key)
                self.retry(key, 1.0)
            finally:
                self._running.discard(key)
            if key in self._dirty:
                self._dirty.discard(key)
                self.add(key)
