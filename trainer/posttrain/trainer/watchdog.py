"""The trainer's own progress deadline (spec.scheduling.progressDeadlineSeconds): a
thread that ends the process when its loop stops moving (a hung collective, a deadlocked
host, a step that never returns), so that the JobSet restarts it instead of the chips
idling with the pods Running.

The loop beats (`beat`, from `posttrain.trainer.progress.Progress`, on every process) with
the phase it is in; when a phase lasts longer than `heartbeat.deadline_seconds` allows,
the watchdog prints one line saying since when and where it stood, then the stack of
every thread (faulthandler), and exits with HUNG_EXIT_CODE (a crash: the JobSet
restarts the job, counted against maxRestarts). Should the watchdog thread itself not
run (a call that holds the GIL), faulthandler's own timer, re-armed by each of its
rounds, dumps the stacks and exits (with code 1) BACKSTOP_S later.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from posttrain.api import heartbeat

log = logging.getLogger("posttrain.watchdog")

HUNG_EXIT_CODE = 70  # EX_SOFTWARE: not the input's fault (65), worth a restart
BACKSTOP_S = 60.0


class Watchdog:
    """Ends the process when no `beat` comes within the deadline of the current phase."""

    def __init__(
        self,
        deadline_s: int,
        *,
        exit: Callable[[int], object] = os._exit,
        out: TextIO | None = None,
        backstop: bool = True,
    ):
        self.deadline_s = deadline_s
        self._exit, self._out, self._backstop = exit, out, backstop
        self._lock = threading.Lock()
        self._phase, self._step = heartbeat.LOADING, None
        self._last = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="posttrain-watchdog", daemon=True)
        self.fired = threading.Event()

    def beat(self, phase: str, step: int | None = None) -> None:
        with self._lock:
            self._phase, self._last = phase, time.monotonic()
            if step is not None:
                self._step = step

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)
        if self._backstop:
            faulthandler.cancel_dump_traceback_later()

    def _left(self) -> tuple[float, float]:
        """(seconds left in this phase, the phase's deadline)."""
        with self._lock:
            allowed = heartbeat.deadline_seconds(self.deadline_s, self._phase)
            assert allowed is not None
            return allowed - (time.monotonic() - self._last), allowed

    def _run(self) -> None:
        poll = max(0.05, min(5.0, self.deadline_s / 10))
        out = self._out or sys.stderr
        while not self._done.wait(poll):
            left, allowed = self._left()
            if left <= 0:
                self._fire(out, allowed)
                return
            if self._backstop:
                with contextlib.suppress(ValueError, OSError, AttributeError):
                    # A stream without a file descriptor (captured): no backstop.
                    faulthandler.dump_traceback_later(
                        left + BACKSTOP_S, exit=True, file=sys.__stderr__
                    )

    def _fire(self, out: TextIO, allowed: float) -> None:
        with self._lock:
            phase, step = self._phase, self._step
        where = f"step {step}, {phase}" if step is not None else phase
        print(
            f"posttrain: no progress for {allowed:.0f} s (last: {where}); "
            "spec.scheduling.progressDeadlineSeconds passed: the stack of every thread "
            f"follows, then the trainer exits with code {HUNG_EXIT_CODE}",
            file=out,
            flush=True,
        )
        try:
            faulthandler.dump_traceback(file=out, all_threads=True)
        except (ValueError, OSError, AttributeError):  # no file descriptor: Python's own
            import traceback

            frames = sys._current_frames()
            for thread in threading.enumerate():
                if (frame := frames.get(thread.ident)) is not None:
                    print(f"Thread {thread.name}:", file=out)
                    traceback.print_stack(frame, file=out)
        out.flush()
        if self._backstop:
            faulthandler.cancel_dump_traceback_later()
        self.fired.set()
        self._exit(HUNG_EXIT_CODE)


_current: Watchdog | None = None


def beat(phase: str, step: int | None = None) -> None:
    """The loop moved (a step, a new phase): a no-op without a running watchdog."""
    if (dog := _current) is not None:
        dog.beat(phase, step)


@contextlib.contextmanager
def watching(deadline_s: int, **kwargs) -> Iterator[Watchdog | None]:
    """A watchdog over the block (none when the deadline is 0)."""
    global _current
    if deadline_s <= 0:
        yield None
        return
    dog = Watchdog(deadline_s, **kwargs).start()
    _current = dog
    try:
        yield dog
    finally:
        _current = None
        dog.stop()
