"""A flag that code a signal handler may interrupt sets, and any thread waits for (the engine's start and stop, a
gate's holder letting go, a pool closed, a pacing wait given up)."""

from __future__ import annotations

import queue
import time

# A waiter looks at the flag this often whatever the tokens say: a set() interrupted between its store and its
# put (no eval-breaker check lies there in CPython 3.11, but nothing promises it) is late by this much, not lost.
RECHECK_SECONDS = 0.5


class Flag:
    """A one-way ``threading.Event``: :meth:`set` is a store and one C call (``SimpleQueue.put``), so a signal
    handler's exception landing in it leaves no lock held, as one landing in ``Event.set`` or ``Event.wait`` on
    the main thread can (``Condition.__enter__`` is Python code: a raise after its C acquire returns keeps the
    lock, and every later set or wait hangs, a wait with a timeout too). A token wakes one waiter, who puts it
    back for the next; its ``finally`` puts it back even when a handler raises as the get returns."""

    __slots__ = ("_set", "_token")

    def __init__(self) -> None:
        self._set = False
        self._token: queue.SimpleQueue[None] = queue.SimpleQueue()

    def set(self) -> None:
        self._set = True  # before the token: a set interrupted between the two still reads as set
        self._token.put(None)

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Until set (True), or ``timeout`` seconds passed and it is not (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._set:
            left = RECHECK_SECONDS if deadline is None else min(RECHECK_SECONDS, deadline - time.monotonic())
            if left <= 0:
                return False
            try:
                self._token.get(timeout=left)
            except queue.Empty:
                pass
            finally:
                if self._set:  # the token back for the next waiter (a spare one wakes a waiter that finds it set)
                    self._token.put(None)
        return True
