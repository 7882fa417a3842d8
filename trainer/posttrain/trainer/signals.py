"""Stopping a run on SIGTERM/SIGINT: at once before the first step (nothing to save),
after the step with a checkpoint once steps run, and at once on a second signal.

Nothing is ever raised from the Python signal handler: Python runs it between any two
bytecodes of the main thread, which may be inside a garbage-collection callback (JAX
registers one, `_xla_gc_callback`) where an exception is printed as "Exception ignored"
and lost, and the run goes on. The handler only records the signal; a thread reading the
signal wakeup fd (written by the C-level handler, whatever the main thread is doing,
even inside one long C call such as an XLA compile) ends the process itself when no step
has started, and otherwise sets the flag the loop checks after each step."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("posttrain.trainer")
STOPPED_EXIT_CODE = 143  # SIGTERM: the JobSet restarts the job
INTERRUPTED_EXIT_CODE = 130  # Ctrl-C before the first step: nothing saved


def exit_code(signum: int) -> int:
    """The exit code of a run stopped by `signum` before its first step."""
    return STOPPED_EXIT_CODE if signum == signal.SIGTERM else INTERRUPTED_EXIT_CODE


def stopped_line(signum: int) -> str:
    """The last line a run stopped before its first step prints."""
    return f"posttrain: {signal.Signals(signum).name} before the first step; nothing saved"


class Interrupted(BaseException):
    """SIGTERM/SIGINT before the first training step, raised (from ordinary code, never
    from the signal handler) by `StopFlag.check` or `StopFlag.training` when no watcher
    thread ended the process. A BaseException, so no `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopFlag:
    """SIGTERM/SIGINT. Before the first training step has been compiled and dispatched
    (`training` not yet called) a signal ends the process at once, saving nothing (the
    watcher thread runs `on_exit`'s cleanups, prints `stopped_line` and exits with
    `exit_code`); once steps run the flag is set: finish the step, checkpoint, exit. A
    second signal then exits at once, without that checkpoint.

    Without a watcher (not the main interpreter) the signal is only recorded, and the
    main thread raises Interrupted at its next `check()` or at `training()`."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.stepping = False
        self.pending: int | None = None  # a signal handled before the first step
        self.handled = 0  # signals whose Python handler has run
        self.seen = 0  # signals the watcher has read from the wakeup fd
        self.watching = False
        self.cleanups: list[Callable[[], None]] = []
        self._lock = threading.Lock()  # the watcher's decision against training()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter
            os.close(read)
            os.close(write)
            return
        self.watching = True
        threading.Thread(target=self._watch, args=(read,), name="signals", daemon=True).start()

    def on_exit(self, cleanup: Callable[[], None]) -> None:
        """Run `cleanup` (e.g. removing a scratch directory) if a signal ends the process
        before the first step."""
        self.cleanups.append(cleanup)

    def check(self) -> None:
        """A safe point before the first step: raise Interrupted for a signal recorded
        (by a handler with no watcher to end the process)."""
        if self.pending is not None and not self.stepping:
            raise Interrupted(self.pending)

    def training(self) -> None:
        """Steps start now: from here a signal checkpoints after the step."""
        with self._lock:  # the watcher either ended the process already or sees stepping
            self.check()
            self.stepping = True

    def _watch(self, read: int) -> None:
        stop = {int(signal.SIGTERM), int(signal.SIGINT)}
        while chunk := os.read(read, 64):
            for signum in (s for s in chunk if s in stop):
                with self._lock:
                    self.seen += 1
                    if not self.stepping:  # nothing to save: end the process now
                        self._exit_before_start(signum)
                if self.seen > 1:
                    self._exit_now(signum)
                self.event.set()
                log.warning(
                    "received %s: checkpointing after this step (again to exit at once)",
                    signal.Signals(signum).name,
                )

    def _exit_before_start(self, signum: int) -> None:
        for cleanup in self.cleanups:
            try:
                cleanup()
            except Exception as e:  # noqa: BLE001 - exiting anyway; say what was left
                log.warning("while stopping: %s", e)
        logging.shutdown()
        print(stopped_line(signum), file=sys.stderr, flush=True)
        os._exit(exit_code(signum))

    def _exit_now(self, signum: int) -> None:
        name = signal.Signals(signum).name
        log.warning("received %s again: exiting now, without that checkpoint", name)
        logging.shutdown()
        os._exit(128 + signum)

    def _handle(self, signum: int, frame: Any) -> None:
        # No raise and no lock here: this may run inside any bytecode of the main thread
        # (a GC callback, the middle of training()).
        self.handled += 1
        if not self.stepping:
            self.pending = signum  # the watcher ends the process; else check() raises
            return
        if self.watching:  # the watcher says so, and exits on a second one
            self.event.set()
            return
        if self.event.is_set():
            self._exit_now(signum)
        log.warning(
            "received %s: checkpointing after this step (again to exit at once)",
            signal.Signals(signum).name,
        )
        self.event.set()

    def __bool__(self) -> bool:
        return self.event.is_set()
