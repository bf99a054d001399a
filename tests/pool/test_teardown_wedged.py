"""A runtime call that never returns (a wedged driver) during teardown: the first Ctrl-C is logged
(``pool.unpin.waiting``, naming the call), the third abandons the teardown, reporting the leak,
and the process exits (the wedged unpin worker is a daemon). Real SIGINTs to a child process."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from .. import preloaded

CHILD = textwrap.dedent(
    """
    import asyncio, logging, sys, threading
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
    import pinpool
    from pinpool.testing import FakeRegistrar, FakeRuntime

    def before(op, ptr, nbytes):
        if op == "unregister":
            print("wedged", flush=True)
            threading.Event().wait()  # never returns

    wedged = sys.argv[2] == "registrar"  # a transfer engine's unregister wedges, not the runtime's
    fake = FakeRuntime(before_call=None if wedged else before)
    engines = [FakeRegistrar("engine", before_call=before)] if wedged else []
    pool = pinpool.PinnedPool(size="64MiB", chunk_bytes="8MiB", runtime=fake, registry=None, unpin_workers=1,
                              registrars=engines)

    async def body():
        async with pool:
            pass

    try:
        if sys.argv[1] == "sync":
            with pool:
                pass
        elif sys.argv[1] == "asyncio":
            asyncio.run(body())
        else:
            import trio
            trio.run(body)
    finally:
        print("state", pool.state.value, flush=True)
    """
)


@pytest.mark.parametrize(
    ("driver", "wedged"),
    [("sync", "runtime"), ("asyncio", "runtime"), ("trio", "runtime"), ("trio", "registrar")],
)
def test_three_ctrl_c_abandon_a_wedged_teardown(driver: str, wedged: str) -> None:
    child = preloaded.spawn(
        [sys.executable, "-c", CHILD, driver, wedged], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    watchdog = threading.Timer(120, child.kill)  # a regression fails the test (reads end at EOF), never hangs it
    watchdog.start()
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "wedged"
        lines = []
        child.send_signal(signal.SIGINT)
        for line in child.stdout:  # the first Ctrl-C is told, with the call it waits on
            lines.append(line)
            if "pool.unpin.waiting" in line:
                break
        op = "engine unregister" if wedged == "registrar" else "unregister"
        assert f"op='{op}'" in lines[-1] and "abandon_after=3" in lines[-1], lines
        for _ in range(2):
            time.sleep(0.2)
            child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=60)
    finally:
        watchdog.cancel()
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert "state closed" in out, out
    assert "UnpinError" in out and "(Abandoned)" in out and "may still be pinned" in out, out
    if wedged == "registrar":  # the runtime never unpins what an engine may still hold: every chunk is kept
        assert "engine: offset=" in out and "64 MiB may still be pinned" in out, out
    assert child.returncode in ((1,) if driver == "asyncio" else (-signal.SIGINT, 130)), (child.returncode, out)
