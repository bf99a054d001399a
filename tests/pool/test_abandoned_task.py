"""A task abandoned while it opens (or exits) a pool: its event loop is closed with the task pending and still
referenced (asyncio's docs tell users to keep references to background tasks), so the task never
runs again and its coroutine is never closed.

Issue 33, item 3: 1 GiB stayed locked, ``close()`` from another thread hung, the interpreter could
not exit (the close's helper thread waited), and pinpool's SIGINT handler stayed installed, so a
later ``asyncio.run`` skipped its own Ctrl-C handling. Each case runs in a child process with the
real mlock runtime and a real event loop, stopped from ``on_progress`` while the pool pins (the
task is then parked in pinpool's wait) and closed. trio has no loop that can be closed under a
waiting task (``trio.run`` returns only once every task has), except in guest mode: there the host
asyncio loop is closed instead.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

import pinpool

from .. import preloaded
from ..conftest import needs_mlock
from .test_interpreter_exit import PRELUDE

pytestmark = needs_mlock

ABANDON = """
import asyncio, os, signal, sys, threading
import trio
from pinpool._pin import sigint
loop = asyncio.new_event_loop()
def stop_mid_open(pinned, total, chunks_done, chunks):
    if PHASE == "enter" and 0 < pinned < total:
        loop.stop()  # the task is parked in pinpool's wait for its pinning threads
pool = pinpool.PinnedPool(size="1GiB", runtime="mlock", name="abandoned", chunk_bytes="8MiB",
                          register_workers=1, populate_workers=1, on_progress=stop_mid_open)
if BACKEND == "asyncio":
    async def hold():
        async with pool:
            if PHASE == "exit":
                loop.call_soon(loop.stop)  # runs once the exit below awaits its unpinning threads
            else:
                await asyncio.sleep(3600)
    task = loop.create_task(hold())  # referenced to the end: never collected, its coroutine never closed
else:
    async def hold():
        async with pool:
            await trio.sleep(3600)
    trio.lowlevel.start_guest_run(hold, run_sync_soon_threadsafe=loop.call_soon_threadsafe, done_callback=print)
loop.run_forever()
loop.close()
assert pool.state is (pinpool.PoolState.CLOSING if PHASE == "exit" else pinpool.PoolState.PINNING), pool.state
handler = signal.getsignal(signal.SIGINT)
assert handler is not sigint._handler, "pinpool's SIGINT handler is left installed"
if BACKEND == "asyncio":
    assert handler is signal.default_int_handler, handler
print("ABANDONED", flush=True)
if CLOSER == "thread":
    closer = threading.Thread(target=pool.close, daemon=True)
    closer.start()
    closer.join(60)
    assert not closer.is_alive(), "close() from another thread hangs"
elif CLOSER == "main":
    pool.close()
if CLOSER != "none":
    assert pool.state is pinpool.PoolState.CLOSED and vmlck() == 0, (pool.state, vmlck())
    print("CLOSED", flush=True)
if BACKEND == "asyncio":
    # A later asyncio.run has its own Ctrl-C handling: a real SIGINT cancels its main task, then raises.
    async def main():
        assert getattr(signal.getsignal(signal.SIGINT), "func", None).__name__ == "_on_sigint"
        os.kill(os.getpid(), signal.SIGINT)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            print("MAIN_TASK_CANCELLED", flush=True)
            raise
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        print("KEYBOARD_INTERRUPT", flush=True)
"""


CASES = [(backend, "enter", closer) for backend in ("asyncio", "trio-guest") for closer in ("thread", "main", "none")]


@pytest.mark.parametrize(
    ("backend", "phase", "closer"), [*CASES, ("asyncio", "exit", "thread"), ("asyncio", "exit", "none")]
)
def test_a_task_abandoned_in_pinpool_is_finished_by_close_or_at_exit(backend: str, phase: str, closer: str) -> None:
    script = PRELUDE + f"BACKEND, PHASE, CLOSER = {backend.split('-')[0]!r}, {phase!r}, {closer!r}\n" + ABANDON
    result = preloaded.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr  # it exits: no helper thread waits for ever
    out = result.stdout
    assert "ABANDONED" in out, (out, result.stderr)
    assert ("CLOSED" in out) is (closer != "none"), out
    if backend == "asyncio":
        assert "MAIN_TASK_CANCELLED" in out and "KEYBOARD_INTERRUPT" in out, out
    assert re.findall(r"VMLCK_AT_EXIT (\d+)", out) == ["0"], (out, result.stderr)
    if phase == "enter":  # rolled back: pinning was stopped, what it pinned unpinned
        assert "cause='cancelled'" in result.stderr, result.stderr
    if closer == "none":  # the finalizer at exit finished it, and says so
        assert "UnclosedPoolWarning" in result.stderr and "event loop was closed" in result.stderr, result.stderr
    # Nothing raised in pinpool's code (an abandoned trio guest run prints trio's own tracebacks at exit).
    assert f'File "{os.path.dirname(pinpool.__file__)}' not in result.stderr and "leaked" not in result.stderr
