"""Finding 1 (issue 23): a Ctrl-C as teardown starts, with the real mlock runtime, in a child process.

The child pins 16 MiB (8 chunks) with ``with``, and in the body arms a trace that sends a real
SIGINT (``signal.raise_signal``) at the n-th line event of pinpool's code once the ``with``
block's exit has begun (n = 1..LINES: the exit's first lines, ``Lifecycle.exit``, the state move,
``begin_teardown``). Before the fix the exit raised ``KeyboardInterrupt`` with the pool left
``closing``, 8 chunks registered and its range claimed; VmLck stayed up after ``del`` and ``gc``,
``close()`` from another thread waited for ever and the interpreter never exited. Now: the
``KeyboardInterrupt`` comes out after the teardown, the pool is closed, VmLck is back to 0,
``close()`` from another thread returns, and the child exits by itself.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from .. import preloaded
from ..conftest import needs_mlock

LINES = 60  # line events from the start of __exit__: past begin_teardown and the unpin step's launch

CHILD = textwrap.dedent(
    """
    import gc, os, signal, sys, threading
    import pinpool
    from pinpool._host import libc as _libc
    from pinpool._ranges import PINNED_RANGES

    package = os.path.dirname(pinpool.__file__) + os.sep
    at = count = 0

    def lines(frame, event, arg):
        global count
        if event == "line":
            count += 1
            if count == at:
                signal.raise_signal(signal.SIGINT)
        return lines

    def calls(frame, event, arg):
        return lines if frame.f_code.co_filename.startswith(package) else None

    def once():
        global count
        count = 0
        pool = pinpool.PinnedPool(size="16MiB", chunk_bytes="2MiB", runtime="mlock", registry=None, unpin_workers=2)
        caught = "-"
        try:
            with pool:
                assert _libc.vm_locked_bytes() >= 16 << 20
                sys.settrace(calls)  # the next pinpool line is the exit's first
        except KeyboardInterrupt:
            caught = "KeyboardInterrupt"
        finally:
            sys.settrace(None)
        closer = threading.Thread(target=pool.close, daemon=True)
        closer.start()
        closer.join(5)
        state = pool.state.value
        del pool
        gc.collect()
        print(at, caught, "hung" if closer.is_alive() else "returned", state, _libc.vm_locked_bytes(),
              len(PINNED_RANGES.snapshot()), "fired" if count >= at else "not-reached", flush=True)

    for at in range(1, int(sys.argv[1]) + 1, int(sys.argv[2])):
        once()
    """
)


@needs_mlock
def test_a_ctrl_c_as_teardown_starts_unpins_everything_and_the_interpreter_exits() -> None:
    step = 1  # every line: a life costs ~25 ms in a child forked with torch imported (its gc has frozen torch)
    try:
        child = preloaded.run(
            [sys.executable, "-c", CHILD, str(LINES), str(step)], capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"the child never exited; it printed {timeout.stdout!r}")
    assert child.returncode == 0, child.stderr[-2000:]
    lives = [line.split() for line in child.stdout.splitlines()]
    assert len(lives) == len(range(1, LINES + 1, step)), child.stdout
    for at, caught, closer, state, vmlck, claims, fired in lives:
        assert (closer, state, vmlck, claims) == ("returned", "closed", "0", "0"), (at, child.stdout)
        assert fired == "fired" and caught == "KeyboardInterrupt", (at, child.stdout)  # delivered after teardown
