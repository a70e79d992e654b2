"""Preemption: SIGTERM sets a flag; the loop stops after the current step with a
checkpoint saved. With several hosts, every host stops at the same step."""

from __future__ import annotations

import signal
import threading

from seqcache.training import distributed


class StopFlag:
    """Set by SIGTERM; installed only in the main thread for the duration of ``fit``."""

    def __init__(self):
        self.event = threading.Event()
        self._previous = None
        self._installed = False

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def _handle(self, signum, frame):
        self.event.set()

    def uninstall(self):
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False


def stop_agreed(stop: StopFlag, checkpointer, done: int, *, multi_host: bool) -> bool:
    """Whether to stop after ``done`` updates. A SIGTERM may reach some hosts a
    step later than others, or not at all, so several hosts agree on their flags
    after every step (``distributed.any_process``) and ask JAX's preemption
    service (through Orbax): every host stops, and saves, at the same step.
    """
    if not multi_host:
        return stop.event.is_set()
    stopped = distributed.any_process(stop.event.is_set())
    if not stopped and checkpointer is not None:
        stopped = checkpointer.reached_preemption(done)
    return stopped
