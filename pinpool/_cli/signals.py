"""How the command line takes SIGTERM and Ctrl-C: the first one interrupts, later ones wait.

:func:`sigterm_as_interrupt` installs :class:`Interrupts` for the command's run; :func:`current`
is the running command's, which ``pin`` reads while it holds a pool and while the pool exits.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

CTRL_C = "Ctrl-C"
SIGTERM = "SIGTERM"


def signal_name(what: str) -> str:
    """The signal's own name for an interruption's label (``Ctrl-C`` is SIGINT)."""
    return "SIGINT" if what == CTRL_C else what


class Interrupts:
    """How the command takes SIGTERM (and Ctrl-C, while Python's own handler has it).

    The first signal raises KeyboardInterrupt in the main thread, so pinning stops and rolls back
    as for Ctrl-C (a container's stop, systemd, kill). After that, and from the moment the pool
    starts to exit (:meth:`defer`), a signal only is recorded: an exception raised inside the
    pool's teardown would land in whatever runs there, and one raised in the finalizer that
    unmaps the memory is printed as "Exception ignored" and lost (the command then exited 0).
    ``main`` turns a recorded signal into the interrupted status once the pool is gone.
    """

    def __init__(self) -> None:
        self.armed = True
        self.pending: str | None = None  # the signal that arrived while deferred ("SIGTERM", "Ctrl-C")
        self.stopping = False  # a signal ended a hold: later ones repeat that request

    def handle(self, signum: int, frame: FrameType | None) -> None:
        what = SIGTERM if signum == signal.SIGTERM else CTRL_C
        if self.armed:
            self.armed = False  # before raising: whatever the exception unwinds through is not interrupted again
            raise KeyboardInterrupt(what)
        if self.pending is None and not self.stopping:
            self.pending = what

    def defer(self) -> None:
        self.armed = False


_interrupts: Interrupts | None = None  # the running command's, while main() runs on the main thread


def current() -> Interrupts | None:
    """The running command's :class:`Interrupts`; None off the main thread or outside main()."""
    return _interrupts


def defer_interrupts() -> None:
    if _interrupts is not None:
        _interrupts.defer()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[Interrupts | None]:
    """Install :class:`Interrupts` for SIGTERM, and for SIGINT unless someone else handles it; the
    previous handlers are restored after. Off the main thread, signals are left alone."""
    global _interrupts
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    interrupts = Interrupts()
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, interrupts.handle)}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupts.handle)
    outer, _interrupts = _interrupts, interrupts
    try:
        yield interrupts
    finally:
        _interrupts = outer
        for signum, handler in previous.items():
            signal.signal(signum, handler)
