"""Ctrl-C on the main thread: deferred while pinpool's own code runs, delivered at safe points.

Python delivers ``KeyboardInterrupt`` between any two bytecodes of the main thread, so a Ctrl-C
could land between two stores of a book, or between a teardown's start and its first step, and
leave a pool half-moved. Patching lines one by one never ends; instead, while a driver runs
(:func:`guard`), SIGINT goes to :func:`_handler`, which looks at the frames the signal landed
in, as trio's KI protection does:

* in code marked :func:`protected` (the drivers, and everything they call: the lifecycle, the
  engine, the books, the memory source), the signal is only recorded; the guard replays it
  (calls the handler it replaced, which for Python's default raises ``KeyboardInterrupt``) when
  the driver is done, or at the next safe point;
* in code marked :func:`safe` (the wait for pinning threads, which stops pinning when
  interrupted), and anywhere else (another asyncio task or trio's loop while a driver awaits),
  it goes straight to the replaced handler, as if pinpool had installed nothing.

Only the main thread receives signals and may change handlers; elsewhere the guard does
nothing. A handler that is not a Python callable (``SIG_IGN``, ``SIG_DFL``) is left alone. A
marked frame costs nothing until a signal arrives; a guard costs two ``signal.signal`` calls.
"""

from __future__ import annotations

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
    """Mark ``fn`` (a function, generator or coroutine function): a SIGINT landing in it, or in
    anything it calls, is deferred while a guard is installed."""
    _PROTECTED.add(fn.__code__)
    return fn


def safe(fn: F) -> F:
    """Mark ``fn`` a safe point: a SIGINT landing in it, or in what it calls, is delivered at once."""
    _SAFE.add(fn.__code__)
    return fn


class _Guard:
    """The one installed handler's state (only the main thread touches it)."""

    depth = 0  # nested guards (an async driver awaiting while another task's driver runs)
    previous: Callable[[int, FrameType | None], Any] | None = None
    pending = 0  # SIGINTs recorded in protected code and not yet replayed


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
    if _deferring(frame):
        _Guard.pending += 1  # one store: this handler itself runs between two bytecodes
        return
    previous = _Guard.previous
    if previous is not None:
        previous(signum, frame)


def replay() -> None:
    """Deliver a deferred SIGINT now, through the replaced handler (raises ``KeyboardInterrupt``
    under Python's default one, cancels the main task under ``asyncio.run``'s). Call it where the
    caller catches what it raises."""
    previous = _Guard.previous
    if _Guard.pending and previous is not None and threading.current_thread() is threading.main_thread():
        _Guard.pending = 0
        previous(signal.SIGINT, sys._getframe(1))


class guard:
    """Install the deferring handler for the block (main thread only; nested guards share it).

    Enter it from :func:`protected` code: its own lines then defer a signal too. On leaving the
    outermost guard the replaced handler is put back first, then a signal deferred meanwhile is
    replayed. A signal landing between the two is delivered by the replaced handler itself, at the
    block's end: nothing is lost, and nothing of the block is left half done. If the block is
    already raising ``KeyboardInterrupt`` a deferred one is dropped (it was delivered).

    A class, not a generator: ``__enter__`` installs in its last step, so nothing can land between
    the install and the block, where ``__exit__`` would not run."""

    installed = False

    def __init__(self, *, drop: bool = False) -> None:
        # drop: a signal deferred until the outermost guard ends is dropped, not replayed (a
        # finalizer: Python ignores what one raises, and would print it as "Exception ignored").
        self.drop = drop

    def __enter__(self) -> None:
        self.installed = _install()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if not self.installed:
            return
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            _Guard.pending = 0
        _leave(drop=self.drop)


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
    if drop:
        _Guard.pending = 0
    previous = _Guard.previous
    if signal.getsignal(signal.SIGINT) is _handler and previous is not None:
        signal.signal(signal.SIGINT, previous)
    replay()
