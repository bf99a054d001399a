"""Ctrl-C inside pinpool: deferred in its own code, delivered at safe points.

Under :class:`guard`, :func:`_handler` reads its frames as trio's KI protection does: SIGINT in
:func:`protected` code is deferred to the next safe point; while a teardown waits, every one is held.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # the C calls: no Python frame for another handler to run at
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_PROTECTED: set[CodeType] = set()
_SAFE: set[CodeType] = set()


def protected(fn: F) -> F:
    """Mark ``fn``: a SIGINT landing in it, or in anything it calls, is deferred while a guard is installed."""
    _PROTECTED.add(fn.__code__)
    return fn


def safe(fn: F) -> F:
    """Mark ``fn`` a safe point: a SIGINT landing in it, or in what it calls, is delivered at once."""
    _SAFE.add(fn.__code__)
    return fn


class _Guard:
    """The one installed handler's state (only the main thread touches it)."""

    depth = 0  # nested guards (a finalizer or a signal handler's close() inside a driver)
    previous: Callable[[int, FrameType | None], Any] | None = None
    pending = 0  # SIGINTs recorded in protected code and not yet replayed
    owner = 0  # the thread that installed it (a forked child may not have it)
    holding = 0  # teardown waits (hold_interrupts) under way: every SIGINT is held, wherever it lands


def guard_state() -> tuple[int, int]:
    """(nested guards installed, SIGINTs deferred and not yet replayed): both 0 once every guard is left."""
    return _Guard.depth, _Guard.pending


def _deferring(frame: FrameType | None) -> bool:
    while frame is not None:
        code = frame.f_code
        if code in _SAFE:
            return False
        if code in _PROTECTED:
            return True
        frame = frame.f_back
    return False


def _handler(signum: int, frame: FrameType | None) -> None:
    if _Guard.holding or _deferring(frame):
        _Guard.pending += 1  # one store: this handler itself runs between two bytecodes
        return
    previous = _Guard.previous
    if previous is not None:
        previous(signum, frame)


def replay() -> None:
    """Deliver a deferred SIGINT now through the replaced handler, where the caller catches what it raises."""
    previous = _Guard.previous
    if _Guard.pending and previous is not None and threading.current_thread() is threading.main_thread():
        _Guard.pending = 0
        previous(signal.SIGINT, sys._getframe(1))


class guard:
    """Install the deferring handler for the block (main thread only; nested guards share it); leaving
    the outermost one restores it, then replays a deferred signal unless ``drop``. A class, not a
    generator: ``__enter__`` installs in its last step, so nothing lands between it and the block."""

    installed = False

    def __init__(self, *, drop: bool = False) -> None:
        self.drop = drop

    def __enter__(self) -> guard:
        self.installed = _install()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if not self.installed:
            return
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            _Guard.pending = 0
        _leave(drop=self.drop)

    def pause(self) -> None:
        """Leave (and replay) for an await: the loop's own handler is back while control is in the loop."""
        if self.installed:
            self.installed = False
            _leave(drop=self.drop)

    def resume(self) -> None:
        self.installed = _install()


def _install() -> bool:
    if threading.current_thread() is not threading.main_thread():
        return False
    if _Guard.depth:
        _Guard.depth += 1
        return True
    try:
        current = signal.getsignal(signal.SIGINT)
    except (ValueError, TypeError):  # the signal module at interpreter shutdown
        return False
    if not callable(current) or current is _handler:
        return False  # SIG_IGN / SIG_DFL / None: nothing to defer; ours (a stale install): leave it
    _Guard.previous = current
    _Guard.pending = 0
    _Guard.owner = threading.get_ident()
    try:
        _Guard.depth = 1
        signal.signal(signal.SIGINT, _handler)
    except BaseException:
        _Guard.depth = 0
        raise
    return True


def _leave(*, drop: bool = False) -> None:
    _Guard.depth -= 1
    if _Guard.depth:
        return  # a signal deferred meanwhile stays for the outer guard
    _Guard.holding = 0  # a wait that never said it ended holds nothing once no guard is left
    if drop:
        _Guard.pending = 0
    previous = _Guard.previous
    if _signal.getsignal(signal.SIGINT) is _handler and previous is not None:
        _signal.signal(signal.SIGINT, previous)
    replay()


def _forget_in_child() -> None:
    """A guard another thread installed is never left in a forked child: it would defer Ctrl-C for good."""
    if _Guard.depth and _Guard.owner != threading.get_ident():
        _Guard.depth = _Guard.pending = _Guard.holding = 0
        if signal.getsignal(signal.SIGINT) is _handler and _Guard.previous is not None:
            signal.signal(signal.SIGINT, _Guard.previous)


os.register_at_fork(after_in_child=_forget_in_child)
