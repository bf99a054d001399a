"""pin_nice: pin worker threads run nicer than the process (background pools by default).

Each runtime call is made on a worker thread; a FakeRuntime hook reads that thread's nice
value from /proc/self/task/<tid>/stat (field 19), as the kernel sees it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

import pytest

import pinpool
from pinpool import ConfigError
from pinpool._host import libc as _libc
from pinpool._plan import BACKGROUND_PIN_NICE, MAX_NICE
from pinpool.testing import FakeRuntime

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")

AUTO = BACKGROUND_PIN_NICE


def proc_nice(tid: int) -> int:
    """Field 19 (nice) of /proc/self/task/<tid>/stat; the fields after ``comm`` start at field 3."""
    with open(f"/proc/self/task/{tid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[19 - 3])


def this_nice() -> int:
    return proc_nice(threading.get_native_id())


class Seen:
    """Every (op, thread, nice) a FakeRuntime call ran with."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def __call__(self, op: str, ptr: int, nbytes: int) -> None:
        tid = threading.get_native_id()
        nice = proc_nice(tid)
        assert nice == os.getpriority(os.PRIO_PROCESS, tid)
        with self._lock:
            self.calls.append((op, tid, nice))

    def nices(self, *ops: str) -> set[int]:
        return {nice for op, _, nice in self.calls if op in ops}


def pool(seen: Seen, **options: object) -> pinpool.PinnedPool:
    fake = FakeRuntime(before_call=seen, register_delay=0.001, lock_on_fault=True)
    return pinpool.PinnedPool(size="64MiB", chunk_bytes="4MiB", runtime=fake, registry=None, **options)  # type: ignore[arg-type]


def expected(increment: int, base: int) -> int:
    return min(MAX_NICE, base + increment)


@pytest.mark.anyio
async def test_background_pool_pins_on_nicer_threads_by_default_and_unpins_at_the_processs_priority() -> None:
    base = this_nice()
    seen = Seen()
    p = pool(seen, background=True)
    async with p:
        await p.wait_ready()
        assert this_nice() == base  # the event loop's thread is never lowered
    assert seen.nices("populate", "register") == {expected(AUTO, base)}
    assert seen.nices("unregister") == {base}  # teardown keeps today's priority
    assert this_nice() == base
    assert {tid for _, tid, _ in seen.calls} - {threading.get_native_id()}  # workers are other threads


@pytest.mark.anyio
@pytest.mark.parametrize("opt_out", [0, None])
async def test_background_pool_opts_out(opt_out: int | None) -> None:
    base = this_nice()
    seen = Seen()
    p = pool(seen, background=True, pin_nice=opt_out)
    async with p:
        await p.wait_ready()
    assert seen.nices("populate", "register", "unregister") == {base}


@pytest.mark.anyio
async def test_foreground_pool_keeps_the_processs_priority_unless_asked() -> None:
    base = this_nice()
    seen = Seen()
    async with pool(seen):
        pass
    assert seen.nices("populate", "register", "unregister") == {base}
    asked = Seen()
    async with pool(asked, pin_nice=5):
        pass
    assert asked.nices("populate", "register") == {expected(5, base)}
    assert asked.nices("unregister") == {base}


def test_sync_background_and_pin_of_a_tensor() -> None:
    import torch

    base = this_nice()
    seen = Seen()
    p = pool(seen, background=True, pin_nice=3)
    with p:
        p.wait_ready_sync(timeout=30)
    assert seen.nices("populate", "register") == {expected(3, base)}
    tensor_seen = Seen()
    fake = FakeRuntime(before_call=tensor_seen)
    with pinpool.pin(torch.zeros(1 << 20), runtime=fake, registry=None, pin_nice=7):
        pass
    assert tensor_seen.nices("register") == {expected(7, base)}
    assert tensor_seen.nices("unregister") == {base}
    default_seen = Seen()
    with pinpool.pin(torch.zeros(1 << 20), runtime=FakeRuntime(before_call=default_seen), registry=None):
        pass
    assert default_seen.nices("register", "unregister") == {base}  # pin() is a foreground pool


def test_the_increment_is_relative_and_capped_at_19() -> None:
    """Workers inherit their starter's nice; pin_nice adds to it, up to Linux's 19."""
    seen = Seen()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 15)  # this throwaway thread only
            with pool(seen, pin_nice=10):
                pass
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors
    assert seen.nices("populate", "register") == {19}
    assert seen.nices("unregister") == {15}


@pytest.mark.parametrize("bad", [-1, 20, 1.5, True, "10", "high", [5]])
def test_bad_values_are_config_errors_naming_value_and_fix(fake: FakeRuntime, bad: object) -> None:
    with pytest.raises(ConfigError) as caught:
        pinpool.PinnedPool(size="64MiB", runtime=fake, registry=None, background=True, pin_nice=bad)  # type: ignore[arg-type]
    message = str(caught.value)
    assert f"pin_nice={bad!r}" in message and "0 to 19" in message and '"auto"' in message


def test_pool_options_check_the_resolved_value() -> None:
    from pinpool._plan import PoolOptions

    with pytest.raises(ConfigError, match="pin_nice=25"):
        PoolOptions(size=1 << 20, pin_nice=25)
    assert PoolOptions(size=1 << 20).pin_nice == 0


def test_a_refused_setpriority_never_fails_pinning_and_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(which: int, who: int, prio: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(_libc.os, "setpriority", refuse)
    monkeypatch.setattr(_libc, "_nice_reported", threading.Event())
    base = this_nice()
    caplog.set_level(logging.DEBUG, logger="pinpool")
    for _ in range(2):
        seen = Seen()
        p = pool(seen, background=True)
        with p:
            p.wait_ready_sync(timeout=30)
            assert p.state is pinpool.PoolState.READY
        assert seen.nices("populate", "register") == {base}
    refused = [r for r in caplog.records if "pin_nice not applied" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.DEBUG
    assert "PermissionError" in refused[0].getMessage()


def test_lower_this_thread() -> None:
    results: dict[str, object] = {}

    def run(key: str, body: Callable[[], object]) -> None:
        thread = threading.Thread(target=lambda: results.__setitem__(key, (body(), this_nice())))
        thread.start()
        thread.join()

    base = this_nice()
    run("zero", lambda: _libc.lower_this_thread(0))
    run("four", lambda: _libc.lower_this_thread(4))
    assert results["zero"] == (None, base)
    assert results["four"] == (expected(4, base), expected(4, base))
    assert this_nice() == base  # only the calling thread changed
