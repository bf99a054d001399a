"""pinpool's worker threads: tracked before they can run, waited for through one Event.

Two rules make every thread accountable, whatever interrupts the thread that starts them:

* A thread is on the books *before* ``Thread.start`` is called, and its body runs only if it
  passes a gate that the starter can close. ``Thread.start`` waits on an Event, so a Ctrl-C can
  land inside it after the OS thread exists; the starter then closes the gate of every thread
  that has not passed it yet, and a thread that starts late does nothing. So "started" is
  decided in one place, under a lock, never guessed.
* Completion is an Event, not ``Thread.join``: on Python 3.11 a join interrupted by Ctrl-C can
  mark a still-running thread as stopped (bpo-45274's fix), and books must never close while a
  worker is mid-call.

A body that raises is recorded (``errors``), never printed by ``threading.excepthook``: the
lifecycle decides what a crashed worker means.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

_POLL_SECONDS = 0.05
PROGRESS_INTERVAL_SECONDS = 0.1


_OPEN, _PASSED, _CLOSED = "open", "passed", "closed"


class Threads:
    """A set of worker threads; ``all_done`` is set once every thread on the books is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0  # on the books and not done: passed its gate, or may still pass it
        self.started = 0  # threads whose body ran (or runs)
        self.errors: list[BaseException] = []
        self.all_done = threading.Event()
        self.all_done.set()

    def start(self, fn: Callable[[], object], *, name: str) -> None:
        """Start ``fn`` on a new thread. If this raises (no thread could be made, or an interrupt
        landed inside ``Thread.start``), the thread is accounted for already: it either runs
        ``fn`` and is waited for, or never runs it."""
        gate = [_OPEN]

        def run() -> None:
            with self._lock:
                if gate[0] is _CLOSED:
                    return  # its start was given up: it must not touch anything
                gate[0] = _PASSED
                self.started += 1
            try:
                fn()
            except BaseException as exc:  # recorded for the lifecycle; a worker has no caller to raise to
                with self._lock:
                    self.errors.append(exc)
            finally:
                self._one_done()

        with self._lock:
            self._running += 1
            self.all_done.clear()
        try:
            threading.Thread(target=run, name=name, daemon=False).start()
        except BaseException:
            with self._lock:
                closed = gate[0] is _OPEN
                gate[0] = _CLOSED if closed else gate[0]
            if closed:  # else its body already began: it is waited for like any other
                self._one_done()
            raise

    def _one_done(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self.all_done.set()

    def join(self) -> None:
        """Block until every thread is done (for a thread that waits on behalf of an interruptible one)."""
        self.all_done.wait()

    @property
    def done(self) -> bool:
        return self.all_done.is_set()

    def wait(self, on_tick: Callable[[], object] | None = None) -> None:
        """Wait until every thread is done; interruptible (timed waits, so Ctrl-C is seen promptly).

        ``on_tick`` runs on the waiting thread about every PROGRESS_INTERVAL_SECONDS.
        """
        last_tick = time.monotonic()
        while not self.all_done.wait(_POLL_SECONDS):
            if on_tick is not None and time.monotonic() - last_tick >= PROGRESS_INTERVAL_SECONDS:
                last_tick = time.monotonic()
                on_tick()
