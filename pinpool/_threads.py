"""Plain threads that are waited for through Events, for the sync driver and for teardown."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

_JOIN_POLL_SECONDS = 0.05
PROGRESS_INTERVAL_SECONDS = 0.1


class Threads:
    """Plain worker threads whose completion is an Event, not Thread.join: on Python 3.11 a
    join interrupted by Ctrl-C can mark a still-running thread as stopped (bpo-45274's fix),
    and rollback must never start while a worker is mid-call."""

    def __init__(self) -> None:
        self._done: list[threading.Event] = []

    def start(self, fn: Callable[[], object], *, name: str) -> None:
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        threading.Thread(target=run, name=name, daemon=False).start()
        self._done.append(done)  # only once started: an unstarted thread has nothing to wait for

    def wait(self, on_tick: Callable[[], object] | None = None) -> None:
        """Wait for every thread; Ctrl-C interrupts the wait (timed, so it is seen promptly).

        ``on_tick`` runs on the waiting thread about every PROGRESS_INTERVAL_SECONDS.
        """
        last_tick = time.monotonic()
        for done in self._done:
            while not done.wait(_JOIN_POLL_SECONDS):
                if on_tick is not None and time.monotonic() - last_tick >= PROGRESS_INTERVAL_SECONDS:
                    last_tick = time.monotonic()
                    on_tick()

    def wait_uninterruptibly(self) -> BaseException | None:
        """Wait for every thread, even through interrupts; returns the first interrupt, if any."""
        interrupted: BaseException | None = None
        while True:
            try:
                self.wait()
                return interrupted
            except BaseException as exc:  # a Ctrl-C must not cut rollback or teardown short
                interrupted = interrupted or exc
