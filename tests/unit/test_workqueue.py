"""WorkQueue.pause: a replica that stops leading runs nothing more, and starts clean."""

from __future__ import annotations

import asyncio

from posttrain.controller.workqueue import WorkQueue


def test_pause_stops_the_work_at_once_and_forgets_every_key():
    async def scenario():
        started, finished, gate = [], [], asyncio.Event()

        async def work(key):
            started.append(key)
            await gate.wait()
            finished.append(key)

        queue = WorkQueue(work, workers=2)
        queue.start()
        for key in ("a", "b", "c"):
            queue.add(key)
        queue.retry("d", 0.05)
        queue.later("e", 0.05)
        await asyncio.sleep(0.02)
        assert started == ["a", "b"] and queue.running
        queue.add("a")  # running: would run once more after
        tasks = queue.pause()
        assert not queue.running and len(queue) == 0
        await asyncio.gather(*tasks, return_exceptions=True)
        gate.set()
        await asyncio.sleep(0.1)  # past the retry and the `later`
        assert finished == [] and started == ["a", "b"]
        queue.add("x")  # paused: queued, nothing runs it
        await asyncio.sleep(0.02)
        assert started == ["a", "b"]
        queue.start()  # leading again: from a clean queue
        await asyncio.sleep(0.02)
        assert started == ["a", "b", "x"] and finished == ["x"]
        await queue.stop()

    asyncio.run(scenario())
