"""Real signals at random moments to a child pinning a real mlock pool; its VmLck must end at 0.

Modes: the sync driver and trio with Ctrl-C (SIGINT once or twice), asyncio.run with Ctrl-C,
and asyncio with the common ``loop.add_signal_handler(SIGTERM, task.cancel)`` recipe (SIGTERM
once or twice). The child reports its VmLck after everything, whatever it caught.
``PINPOOL_SIGNAL_RUNS`` raises the runs per mode (CI runs the default).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from .conftest import needs_mlock

RUNS = int(os.environ.get("PINPOOL_SIGNAL_RUNS", "3"))

CHILD = textwrap.dedent(
    """
    import asyncio, signal, sys, time
    import pinpool, trio
    from pinpool import _libc

    mode = sys.argv[1]
    pool = pinpool.PinnedPool(size="256MiB", chunk_bytes="8MiB", runtime="mlock", registry=None, unpin_workers=2)

    async def body_async(sleep):
        async with pool:
            await sleep(0.15)

    def run():
        if mode == "sync":
            with pool:
                time.sleep(0.15)
        elif mode == "trio":
            trio.run(body_async, trio.sleep)
        elif mode == "asyncio":
            asyncio.run(body_async(asyncio.sleep))
        else:  # asyncio-sigterm: the recipe servers use
            async def main():
                task = asyncio.current_task()
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
                await body_async(asyncio.sleep)
            asyncio.run(main())

    def report(caught):
        print("caught", ",".join(caught) or "-", "vmlck", _libc.vm_locked_bytes(), "state",
              pool._lifecycle.state.value, flush=True)

    print("ready", flush=True)
    caught = []
    try:
        try:
            run()
        except BaseException as exc:
            caught.append(type(exc).__name__)
        report(caught)  # at once: once asyncio.run has closed its loop, SIGTERM is deadly again
        time.sleep(0.05)  # a second signal may still arrive
    except BaseException as exc:
        caught.append(type(exc).__name__)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    report(caught)
    """
)


@needs_mlock
@pytest.mark.parametrize("mode", ["sync", "trio", "asyncio", "asyncio-sigterm"])
def test_real_signals_never_leave_memory_locked(mode: str) -> None:
    rng = random.Random(f"{mode}-signals")
    signum = signal.SIGTERM if mode == "asyncio-sigterm" else signal.SIGINT
    for run in range(RUNS):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.35))  # pinning, the body or the teardown
        child.send_signal(signum)
        if run % 2:  # every other run: a second signal soon after
            time.sleep(rng.uniform(0.0, 0.05))
            if child.poll() is None:
                child.send_signal(signum)
        out, err = child.communicate(timeout=60)
        reports = [line for line in out.splitlines() if line.startswith("caught ")]
        assert reports, (mode, run, child.returncode, out, err)
        report = reports[0]
        # A second signal can land after the event loop has put back the default handlers (the
        # recipe's SIGTERM handler is removed when asyncio.run returns): it may then end the
        # child, as it would a server, but only after the report of its locked memory.
        late_kill = child.returncode == -signal.SIGTERM if mode == "asyncio-sigterm" else bool(run % 2)
        assert child.returncode == 0 or late_kill, (mode, run, child.returncode, out, err)
        fields = report.split()
        assert fields[0] == "caught" and fields[2] == "vmlck", (report, err)
        assert int(fields[3]) == 0, f"{mode} run {run}: {report}\n{err}"
        assert fields[5] == "closed", report
        assert "LedgerError" not in err and "AssertionError" not in err, err
