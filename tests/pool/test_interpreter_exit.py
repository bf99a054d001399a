"""A pool still open when the interpreter exits is unpinned before its memory is unmapped.

Each case runs in a subprocess with the real mlock runtime. The child's oldest finalizer (made
before any pool, so at exit it runs after every pool's, whether or not the interpreter had made a
finalizer before the script began) prints the process's VmLck; the test wants 0 there, an exit
status of 0, and nothing on stderr but the UnclosedPoolWarning that says the pool was never exited.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from .. import preloaded
from ..conftest import needs_mlock
from ..depth import depth
from ..depth import runs as depth_runs

pytestmark = needs_mlock

PRELUDE = """
import re, weakref
def _vmlck_at_the_very_end():
    with open("/proc/self/status") as f:
        kb = int(re.search(r"VmLck:\\s+(\\d+)", f.read()).group(1))
    print(f"VMLCK_AT_EXIT {kb}", flush=True)
_last = type("Last", (), {})()
weakref.finalize(_last, _vmlck_at_the_very_end)  # the oldest finalizer: at exit it runs last
import pinpool
def vmlck():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmLck:\\s+(\\d+)", f.read()).group(1))
"""

CASES = {
    "sync-enter": """
        p = pinpool.PinnedPool(size="256MiB", runtime="mlock", name="left-open")
        p.__enter__()
        assert vmlck() >= 256 * 1024
    """,
    "open": """
        pool = pinpool.PinnedPool(size="256MiB", runtime="mlock", name="left-open").open()
        assert vmlck() >= 256 * 1024
    """,
    "background-mid-pin": """
        pool = pinpool.PinnedPool(size="2GiB", runtime="mlock", name="left-open", background=True).open()
        pool.wait_ready_sync(min_bytes="64MiB")
        assert pool.state is pinpool.PoolState.PINNING, pool.state
        print("PINNING_AT_EXIT", flush=True)
    """,
    "pinned-tensor": """
        import torch
        t = torch.empty(64 << 20, dtype=torch.uint8)
        pinned = pinpool.pin(t, runtime="mlock", name="left-open")
        pinned.__enter__()
        assert vmlck() >= 60 * 1024
    """,
    "async-task-never-finished": """
        import asyncio
        pool = pinpool.PinnedPool(size="256MiB", runtime="mlock", name="left-open")
        async def hold():
            async with pool:
                await asyncio.sleep(3600)
        loop = asyncio.new_event_loop()
        task = loop.create_task(hold())
        for _ in range(1200):  # until the body is reached (a loaded machine pins 256 MiB slowly)
            loop.run_until_complete(asyncio.sleep(0.05))
            if pool.state is pinpool.PoolState.READY:
                break
        assert pool.state is pinpool.PoolState.READY and vmlck() >= 256 * 1024
        # exits with the task suspended inside the body and the loop never closed
    """,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_pool_open_at_interpreter_exit_is_unpinned_first(case: str) -> None:
    script = PRELUDE + textwrap.dedent(CASES[case])
    result = preloaded.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    final = re.findall(r"VMLCK_AT_EXIT (\d+)", result.stdout)
    assert final == ["0"], (result.stdout, result.stderr)
    if case == "background-mid-pin":
        assert "PINNING_AT_EXIT" in result.stdout
    stderr = result.stderr
    for bad in ("Traceback", "Exception ignored", "Error", "unpin.failed", "leaked"):
        assert bad not in stderr, stderr
    # The one thing said: the pool was never exited (a warning, with what was done about it).
    assert "UnclosedPoolWarning" in stderr and "was never exited" in stderr, stderr


# Issue 33, item 7: close() on a daemon thread started right before the main thread returns. The
# interpreter's finalization stopped that thread mid-teardown (a call into torch or the runtime) and
# the process aborted, 2 to 3 runs in 20 ("terminate called without an active exception", rc -6).
DAEMON_CLOSE = """
import threading
pool = pinpool.PinnedPool(size="128MiB", runtime="mlock", name="daemon-close", chunk_bytes="8MiB").open()
assert vmlck() >= 128 * 1024
threading.Thread(target=pool.close, daemon=True).start()
"""


@depth
def test_a_close_on_a_daemon_thread_at_interpreter_exit_finishes_before_the_process_ends() -> None:
    script, runs, at_once = PRELUDE + DAEMON_CLOSE, depth_runs(8, 24), 4
    results: list[subprocess.CompletedProcess[str]] = []
    for _ in range(runs // at_once):  # a few at a time: the race wants a CPU of its own now and then
        children = [preloaded.spawn([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for _ in range(at_once)]  # fmt: skip
        for child in children:
            out, err = child.communicate(timeout=120)
            results.append(subprocess.CompletedProcess(script, child.returncode or 0, out, err))
    failed = [(r.returncode, r.stderr[-300:]) for r in results if r.returncode != 0 or "terminate called" in r.stderr]
    assert failed == [], f"{len(failed)} of {runs} runs: {failed[:3]}"
    # The close finished (VmLck 0 at the very end), or it started once exit had begun and the finalizer unpinned.
    assert all(re.findall(r"VMLCK_AT_EXIT (\d+)", r.stdout) == ["0"] for r in results), [r.stdout for r in results]
