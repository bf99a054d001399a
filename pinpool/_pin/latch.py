"""A gate workers wait at, opened by code a signal handler may interrupt (the engine's start and stop)."""

from __future__ import annotations

import queue


class Latch:
    """A one-way gate: :meth:`open` is one C call (``SimpleQueue.put``), so a signal handler's exception landing
    around it leaves no lock held, as one landing in ``threading.Event.set`` can (``Condition.__enter__`` is
    Python code: a raise after its C acquire returns keeps the lock, and every later set or wait hangs).
    A waiter takes the token and puts it back for the next."""

    def __init__(self) -> None:
        self._token: queue.SimpleQueue[None] = queue.SimpleQueue()

    def open(self) -> None:
        self._token.put(None)

    def wait(self) -> None:
        self._token.get()
        self._token.put(None)
