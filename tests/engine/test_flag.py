"""The Flag that replaces threading.Event where the main thread sets or waits: an exception a signal handler
raises at any point of set() or wait() on the main thread leaves it working for every other waiter. The same
sweep finds threading.Event's lock kept (the hang the 200-pool alarm test met once in 16 runs), so it can fail."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from pinpool._pin import Flag


class Interrupt(Exception):
    """What a signal handler raises (a TimeoutError from an alarm, a KeyboardInterrupt)."""


def interrupted_at(event: int, files: tuple[str, ...], call: Callable[[], object]) -> bool:
    """Run ``call`` raising Interrupt at the ``event``-th opcode executed in ``files``; whether it was raised
    there (False: ``call`` has fewer opcodes, and ran whole)."""
    seen = 0

    def tracer(frame: FrameType, what: str, arg: Any) -> Any:
        nonlocal seen
        if frame.f_code.co_filename not in files:
            return None
        frame.f_trace_opcodes = True
        if what == "opcode":
            seen += 1
            if seen == event:
                raise Interrupt
        return tracer

    sys.settrace(tracer)
    try:
        call()
    except Interrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def others_see_it_set(flag: Any, deadline: float) -> bool:
    """Whether a set and a wait on other threads (a retrying teardown, a closer waiting) return within
    ``deadline`` seconds (daemon threads: a kept lock hangs them for good, not the test)."""
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(flag.wait(deadline)), daemon=True)
    setter = threading.Thread(target=flag.set, daemon=True)
    waiter.start(), setter.start()
    setter.join(deadline), waiter.join(deadline)
    return result == [True] and not setter.is_alive()


def sweep(
    make: Callable[[], Any], files: tuple[str, ...], use: Callable[[Any], object], *, deadline: float = 5.0,
    first: bool = False,
) -> list[int]:  # fmt: skip
    """The opcode events at which an interrupt in ``use`` left the flag broken for the other threads (``first``:
    stop at the first)."""
    broken: list[int] = []
    for event in range(1, 500):
        flag = make()
        if not interrupted_at(event, files, lambda f=flag: use(f)):
            return broken
        if not others_see_it_set(flag, deadline):
            broken.append(event)
            if first:
                return broken
    pytest.fail("the sweep did not reach the end of the call")


FLAG_FILES = (sys.modules[Flag.__module__].__file__ or "",)
EVENT_FILES = (threading.__file__,)


@pytest.mark.parametrize(
    "use", [lambda f: f.set(), lambda f: (f.set(), f.wait()), lambda f: f.wait(0.01), lambda f: f.is_set()],
    ids=["set", "set-then-wait", "wait-timing-out", "is_set"],
)  # fmt: skip
def test_an_interrupt_anywhere_in_flag_leaves_it_working(use: Callable[[Any], object]) -> None:
    assert sweep(Flag, FLAG_FILES, use) == []


def test_the_same_sweep_finds_threading_events_kept_lock() -> None:
    # A healthy set() takes microseconds: a thread still in it after a second waits on the kept lock.
    broken = sweep(threading.Event, EVENT_FILES, lambda e: e.set(), deadline=1.0, first=True)
    assert broken, "threading.Event.set survived every interrupt: the sweep no longer reaches the window"


def test_a_flag_is_an_event_once() -> None:
    flag = Flag()
    assert not flag.is_set() and flag.wait(0.01) is False
    waiters = [threading.Thread(target=flag.wait) for _ in range(4)]
    for waiter in waiters:
        waiter.start()
    flag.set()
    for waiter in waiters:
        waiter.join(5.0)
        assert not waiter.is_alive()  # every waiter wakes: each puts the token back for the next
    assert flag.is_set() and flag.wait() is True and flag.wait(0) is True
