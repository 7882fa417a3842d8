"""Stopping a run on SIGTERM/SIGINT: at once before the first step (nothing to save),
after the step with a checkpoint once steps run, and at once on a second signal."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

log = logging.getLogger("posttrain.trainer")


class Interrupted(BaseException):
    """SIGTERM/SIGINT before the first training step: start-up stops at once (there is
    nothing to checkpoint yet). A BaseException, so no `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopFlag:
    """SIGTERM/SIGINT. Before the first training step has been compiled and dispatched
    (`training` not yet called) a signal raises Interrupted at once; once steps run it is set: finish the step, checkpoint,
    exit. A second signal then exits at once, without that checkpoint.

    Python runs a signal's handler only between bytecodes of the main thread, so not while
    that thread is inside one long C call, such as XLA compiling the first step (a minute
    or more for a large model on CPU). A thread reading the signal wakeup fd (written by
    the C-level handler, whatever the main thread does) says at once what the signal will
    do, and exits at once on a second one."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.stepping = False
        self.handled = 0  # signals whose Python handler has run
        self.seen = 0  # signals the watcher has read from the wakeup fd
        self.base = 0  # signals that came before training(): not counted after it
        self.watching = False
        self.raised = threading.Event()  # the handler raised Interrupted

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

    def training(self) -> None:
        """Steps start now: from here a signal checkpoints after the step."""
        # Signals before this line have been handled (the handler runs at the next
        # bytecode), though the watcher may not have read their bytes yet: count from here.
        self.base = self.handled
        self.stepping = True

    def _watch(self, read: int) -> None:
        stop = {int(signal.SIGTERM), int(signal.SIGINT)}
        while chunk := os.read(read, 64):
            for signum in (s for s in chunk if s in stop):
                self.seen += 1
                count = self.seen - self.base  # this mode's count
                name = signal.Signals(signum).name
                if count < 1:  # an earlier mode's signal, read late
                    continue
                if count > 1:
                    self._exit_now(signum)
                elif self.stepping:
                    log.warning(
                        "received %s: checkpointing after this step (again to exit at once)",
                        name,
                    )
                elif not self.raised.wait(0.5):  # else the run is ending and says so
                    log.warning(
                        "received %s before the first step: stopping once the work in progress "
                        "(loading, an XLA compile) returns, saving nothing (again to exit at "
                        "once)",
                        name,
                    )

    def _exit_now(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.stepping:
            log.warning("received %s again: exiting now, without that checkpoint", name)
        else:
            log.warning("received %s again: exiting now; nothing saved", name)
        logging.shutdown()
        os._exit(128 + signum)

    def _handle(self, signum: int, frame: Any) -> None:
        self.handled += 1
        if not self.stepping:
            self.raised.set()
            raise Interrupted(signum)
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
