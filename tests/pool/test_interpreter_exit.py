"""A pool still open when the interpreter exits is unpinned before its memory is unmapped.

Each case runs in a subprocess with the real mlock runtime. The child's very last atexit
handler (registered before pinpool is imported, so it runs after every finalizer) prints the
process's VmLck; the test wants 0 there, an exit status of 0, and nothing on stderr but the
UnclosedPoolWarning that says the pool was never exited.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from ..conftest import needs_mlock

pytestmark = needs_mlock

PRELUDE = """
import atexit, re
def _vmlck_at_the_very_end():
    with open("/proc/self/status") as f:
        kb = int(re.search(r"VmLck:\\s+(\\d+)", f.read()).group(1))
    print(f"VMLCK_AT_EXIT {kb}", flush=True)
atexit.register(_vmlck_at_the_very_end)  # first registered: runs last
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
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
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
