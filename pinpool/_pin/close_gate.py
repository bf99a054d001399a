"""Who drives a pool right now: one caller at a time enters it or closes it.

``close()`` may be called from any thread, at any moment, and from a signal handler or another
task of an event loop on the very thread that is already entering or closing the pool. The
lifecycle (``_pin/lifecycle.py``) takes the :class:`CloseGate` before it enters or tears down, and
every other caller is told who has it:

* nobody: this caller takes it and does the work;
* another thread: this caller waits until that one lets go (``Driver.done``), then looks again
  (a close during an entry has asked the entry to stop and roll back first);
* this very thread (a signal handler that interrupted the entry or the teardown, or another task
  of the same event loop): it cannot wait for itself, so it asks for the close and returns at
  once; the entry or teardown in progress finishes it.

Taking the gate is one C-level ``dict.setdefault``, inside the ``try`` whose ``finally`` lets it
go, so a signal handler, which Python runs between two bytecodes of the thread it interrupts,
sees either no holder or a whole one (never a half-taken gate it would wait on for ever), and a
``KeyboardInterrupt`` landing around it leaves no holder behind.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from .._errors import NodeWaitCancelled, PoolStateError
from .outcome import closed_during_open
from .steps import RunThreads, Steps

T = TypeVar("T")

__all__ = ["CloseGate", "Driver"]


@dataclass(frozen=True, eq=False)
class Driver:
    """The caller that holds the gate: its thread, what it does, and an event set when it lets go."""

    thread: int
    role: str  # "enter" or "close"
    done: threading.Event = field(default_factory=threading.Event)


class Exit(Protocol):
    """The lifecycle's exit, which an entry that a close() asked to stop runs if it opened anyway."""

    def __call__(
        self, body_error: BaseException | None, *, closing: bool = ..., raise_errors: bool = ...
    ) -> Steps[BaseException | None]: ...


class CloseGate:
    """One pool's gate. ``close_requested``: a ``close()`` was called; an entry in progress reads
    it to stop pinning, roll back and raise instead of opening a pool nobody wants any more."""

    def __init__(self) -> None:
        self._held: dict[str, Driver] = {}
        self.close_requested = False

    def release(self, driver: Driver) -> None:
        """Let go, if ``driver`` holds the gate (an interrupt may have landed before it took it)."""
        if self._held.get("driver") is driver:  # no other thread changes a held gate: only its holder
            del self._held["driver"]
        driver.done.set()

    def enter(self, name: str, describe: str, enter: Callable[[], Steps[None]], exit: Exit) -> Steps[None]:
        """Run ``enter`` holding the gate. A ``close()`` meanwhile asked it to stop (it rolls back and
        raises); if it opened all the same, ``exit`` closes it here, and the entry raises."""
        mine = Driver(threading.get_ident(), "enter")
        try:
            if self._held.setdefault("driver", mine) is not mine:  # atomic: no handler lands inside it
                raise PoolStateError(
                    f"pool {name!r} is being entered or closed by another caller: a PinnedPool is entered once; "
                    "create a new PinnedPool to pin again"
                )
            yield from enter()
        except NodeWaitCancelled as exc:  # a foreground node-pacing wait that a close() cancelled
            if not self.close_requested:
                raise
            raise closed_during_open(describe) from exc
        finally:
            self.release(mine)
        if self.close_requested:  # read after letting go: a close from here on closes the pool itself
            unpinned = yield from exit(None, closing=True, raise_errors=False)
            raise closed_during_open(describe, unpinned)

    def close(
        self, name: str, close: Callable[[], Steps[T]], *, closing: bool, stop_entry: Callable[[], None]
    ) -> Steps[T | None]:
        """Run ``close`` (an exit, or ``closing``: ``close()``) holding the gate, once another thread
        that holds it lets go (an entry is asked to stop first); None at once where this very thread
        holds it: a signal handler, or another task of this thread's event loop, cannot wait for
        itself, and the entry or teardown in progress on this thread finishes the pool."""
        if closing:
            self.close_requested = True  # before looking: an entry that ends now still sees it
        mine = Driver(threading.get_ident(), "close")
        try:
            while (holder := self._held.setdefault("driver", mine)) is not mine:
                if holder.thread == mine.thread:
                    return None
                if holder.role == "enter":
                    if not closing:  # an exit (the end of a with block) of a pool whose entry has not returned
                        raise PoolStateError(f"pool {name!r} is being entered on another thread: exit it once entered")
                    stop_entry()
                ran = yield RunThreads(bodies=(holder.done.wait,), name=f"pinpool-{name}-close")
                if ran.interrupts:
                    raise ran.interrupts[0]
            return (yield from close())
        finally:
            self.release(mine)
