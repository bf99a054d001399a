"""An exception from another signal handler (a server's SIGALRM deadline) at the start of every call the
lifecycle's driving steps make, where CPython runs handlers: the pool is never left held (issue 34 review: a
release in a called __exit__ lost to one left the pool claimed, and close() from another thread hung)."""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

import pytest

import pinpool
from pinpool._pin import Lifecycle, guard_state
from pinpool.testing import FakeRuntime

# The lifecycle's steps that hold a pool while they drive it (each lets go in a finally).
DRIVING = {
    getattr(Lifecycle, name).__code__ for name in ("_enter_gated", "_leave", "finalize", "_deliver_in_background")
} | {sys.modules[guard_state.__module__]._leave.__code__}  # and the Ctrl-C guard's leaving: SIGINT's handler back


class Deadline(Exception):
    pass


def one_life(at: int, how: str) -> tuple[int, bool]:
    """Enter and exit a pool, raising Deadline from a real SIGALRM at the ``at``-th call a driving step makes."""
    seen = 0
    fired = False

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal seen, fired
        caller = frame.f_back
        if event == "call" and caller is not None and caller.f_code in DRIVING:
            seen += 1
            if seen == at:
                fired = True
                signal.raise_signal(signal.SIGALRM)  # the handler runs as the call starts, where CPython checks
        return None

    runtime = FakeRuntime()
    pool = pinpool.PinnedPool(size="1MiB", chunk_bytes="256KiB", runtime=runtime, registry=None)
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        if how == "with":
            with pool:
                pass
        else:
            pool.open()
            pool.close()
    except Deadline:
        pass
    finally:
        sys.settrace(previous)
    closer = threading.Thread(target=pool.close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), f"{how}, deadline at call {at}: close() from another thread hangs"
    assert runtime.registered == {}, f"{how}, deadline at call {at}: left registered"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, f"{how}, deadline at call {at}"
    return seen, fired


@pytest.mark.parametrize("how", ["with", "open-close"])
def test_a_deadline_at_any_call_of_the_driving_steps_leaves_no_pool_held(how: str) -> None:
    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise Deadline

    before = signal.signal(signal.SIGALRM, on_alarm)
    try:
        calls, _ = one_life(0, how)
        assert calls > 5, calls
        for at in range(1, calls + 1):
            one_life(at, how)
    finally:
        signal.signal(signal.SIGALRM, before)
