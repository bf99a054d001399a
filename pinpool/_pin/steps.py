"""What a lifecycle asks its driver to do, and what it gets back: pure values, no threads.

A lifecycle (``_pin/lifecycle.py``) is a generator of these steps; a driver (``_pin/drivers.py``)
runs each one and sends back a :class:`Ran`. Keeping the vocabulary here lets the lifecycle
be written, and tested with scripted results, without importing a driver or a thread.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

T = TypeVar("T")


class Joinable(Protocol):
    """A detached sequence running on its own thread (see :class:`Detach`)."""

    @property
    def done(self) -> bool: ...

    def join(self) -> None: ...


@dataclass(frozen=True)
class RunThreads:
    """Run each body on its own thread and wait for all of them.

    ``interruptible``: an interruption is expected to stop the work early (``on_interrupt``)
    and, under anyio, cancellation of the caller is noticed while the threads run; otherwise
    (teardown) the wait is shielded from the start. ``on_tick`` runs on the waiting thread
    about every 0.1 s while the threads run.
    """

    bodies: tuple[Callable[[], object], ...]
    name: str
    interruptible: bool = False
    on_interrupt: Callable[[], None] = lambda: None
    on_tick: Callable[[], None] | None = None
    on_started: Callable[[], None] = lambda: None  # every thread is started (or no more will be)


@dataclass(frozen=True)
class Detach:
    """Run ``steps`` (a lifecycle sub-sequence) with the sync driver on a new thread, and return
    at once: the :class:`Ran` carries its handle (``Ran.detached``), which the lifecycle later
    waits for with a ``RunThreads`` step over ``handle.join``. ``stop`` asks the sequence to end
    soon; the driver calls it when the interpreter starts to exit (before Python waits for its
    threads), so exiting never waits for a whole pool to pin."""

    steps: Generator[RunThreads | Detach, Ran, None]
    name: str
    stop: Callable[[], None] = lambda: None


@dataclass
class Ran:
    """What happened while a step ran: interruptions that arrived (first first), bodies that raised,
    errors from starting threads (e.g. the host is out of threads), and for :class:`Detach` the
    handle of the thread (accounted for even when starting it was interrupted)."""

    interrupts: list[BaseException] = field(default_factory=list)
    crashed: list[BaseException] = field(default_factory=list)
    start_errors: list[BaseException] = field(default_factory=list)
    started: int = 0
    detached: Joinable | None = None


Step = RunThreads | Detach
Steps = Generator[Step, Ran, T]
