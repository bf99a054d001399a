"""Owners without a ``with`` block: ``open()`` / ``close()``, forks at every state, and interrupts
injected at every step of entry."""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import pinpool
from pinpool import PinError, PoolState, PoolStateError, UnpinError
from pinpool._host import HostMapping
from pinpool._pin import PinSession, PoolMemory, Threads
from pinpool._ranges import PINNED_RANGES
from pinpool.runtimes import MlockRuntime
from pinpool.testing import FakeRuntime, locked_bytes

from ..conftest import needs_mlock

MiB = 1 << 20


def vmlck_kb() -> int:
    return locked_bytes() // 1024


def pool_of(fake: FakeRuntime | str, **kw: Any) -> pinpool.PinnedPool:
    options: dict[str, Any] = {
        "size": 8 * MiB, "chunk_bytes": MiB, "runtime": fake, "registry": None, "register_workers": 1,
        "populate": False, "name": "owned",
    }  # fmt: skip
    options.update(kw)
    return pinpool.PinnedPool(**options)


@pytest.fixture(autouse=True)
def _nothing_claimed() -> Iterator[None]:
    before = PINNED_RANGES.snapshot()  # earlier tests' leaked chunks stay claimed for the process's life
    yield
    assert PINNED_RANGES.snapshot() == before


# -- open() / close() ------------------------------------------------------------------------------


def test_open_returns_the_pool_and_close_is_idempotent(fake: FakeRuntime) -> None:
    pool = pool_of(fake)
    assert pool.open() is pool and pool.state is PoolState.READY and len(fake.registered) == 8
    assert pool.close() is None
    assert pool.state is PoolState.CLOSED and fake.registered == {}
    assert pool.close() is None and len(fake.unregister_calls) == 8  # a second close is a no-op
    with pytest.raises(PoolStateError, match="entered once"):
        pool.open()


def test_close_of_a_pool_never_opened_closes_it(fake: FakeRuntime) -> None:
    pool = pool_of(fake)
    pool.close()
    assert pool.state is PoolState.CLOSED
    with pytest.raises(PoolStateError):
        pool.open()


def test_close_from_other_threads_at_once_unpins_once_and_all_return_closed() -> None:
    fake = FakeRuntime(unregister_delay=0.01)
    pool = pool_of(fake).open()
    states: list[PoolState] = []

    def close() -> None:
        pool.close()
        states.append(pool.state)  # a close returns only once the pool is closed

    threads = [threading.Thread(target=close) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert states == [PoolState.CLOSED] * 4
    assert sorted(fake.unregister_calls) == sorted(set(fake.unregister_calls)) and len(fake.unregister_calls) == 8


def test_close_stops_a_background_pinning_from_another_thread() -> None:
    fake = FakeRuntime(register_delay=0.02)
    pool = pool_of(fake, background=True, size=32 * MiB).open()
    pool.wait_ready_sync(min_bytes=MiB)
    closer = threading.Thread(target=pool.close)
    closer.start()
    closer.join(10)
    assert pool.state is PoolState.CLOSED and fake.registered == {} and len(fake.register_calls) < 32


def test_close_raises_an_unpin_error_or_returns_it_for_a_destructor() -> None:
    fake = FakeRuntime(fail_unregister_on=2)
    pool = pool_of(fake).open()
    with pytest.raises(UnpinError, match="failed to unregister") as info:
        pool.close()
    assert pool.state is PoolState.CLOSED and len(fake.registered) == 1
    leaked_base = min(fake.registered) - info.value.leaked[0].offset  # which chunk: the unpin workers' order
    assert PINNED_RANGES.pop(leaked_base) is not None  # a leaked chunk's pool stays claimed

    fake = FakeRuntime(fail_unregister_on=2)
    pool = pool_of(fake, name="destructor").open()
    error = pool.close(raise_errors=False)
    assert isinstance(error, UnpinError) and error.leaked
    leaked_base = min(fake.registered) - error.leaked[0].offset
    assert PINNED_RANGES.pop(leaked_base) is not None  # its memory stays claimed: part may be pinned


def test_close_returns_an_unseen_background_failure_for_a_destructor() -> None:
    fake = FakeRuntime(fail_register_on=3)
    pool = pool_of(fake, background=True, max_retries=0).open()
    deadline = time.monotonic() + 60  # polled, so as not to see the failure: a loaded host took over 5 s
    while pool.state is not PoolState.FAILED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(fake.registered) == 2  # kept: the body may be using them
    error = pool.close(raise_errors=False)
    assert isinstance(error, PinError) and fake.registered == {}


@needs_mlock
@pytest.mark.parametrize("where", ["same thread", "another thread"])
def test_after_close_the_callers_mmap_can_be_closed_at_once(where: str) -> None:
    before = vmlck_kb()
    region = mmap.mmap(-1, 16 * MiB)
    tensor = torch.frombuffer(region, dtype=torch.uint8)
    pool = pinpool.pin(tensor, runtime="mlock", registry=None).open()
    assert vmlck_kb() >= before + 16 * 1024
    if where == "same thread":
        pool.close()
    else:
        closer = threading.Thread(target=pool.close)
        closer.start()
        closer.join(10)
    assert vmlck_kb() == before
    del tensor
    region.close()  # BufferError ("exported pointers exist") if the pool still held the storage
    assert pool.state is PoolState.CLOSED  # the pool object is alive: it just refers to nothing


# -- forks --------------------------------------------------------------------------------------------


def in_forked_child(action: Any, timeout: float = 10.0) -> str:
    """Fork; the child runs ``action()`` and reports "ok" or the error; a hang is a failure."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            action()
            message = "ok"
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, _status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(read)
        raise AssertionError("the forked child hung")
    with os.fdopen(read) as f:
        return f.read()


@pytest.mark.parametrize("state", ["new", "pinning-background", "ready", "failed", "closed"])
@pytest.mark.parametrize("how", ["close", "exit", "collect"])
def test_a_forked_child_never_waits_for_or_touches_its_parents_pool(state: str, how: str) -> None:
    fake = FakeRuntime(register_delay=0.02, fail_register_on=4 if state == "failed" else None)
    pool = pool_of(fake, background=state in ("pinning-background", "failed"), size=32 * MiB, max_retries=0)
    if state != "new":
        pool.open()
    if state == "pinning-background":
        pool.wait_ready_sync(min_bytes=MiB)
    if state == "failed":
        deadline = time.monotonic() + 60
        while pool.state is not PoolState.FAILED and time.monotonic() < deadline:
            time.sleep(0.01)
    if state == "closed":
        pool.close()
    registered = dict(fake.registered)
    unregistered = list(fake.unregister_calls)

    def child() -> None:
        if how == "close":
            pool.close()
        elif how == "exit" and state not in ("new",):
            pool.__exit__(None, None, None)
        elif how == "collect":
            pool._finalizer()
        assert pool.state is (PoolState.NEW if state == "new" and how != "close" else PoolState.CLOSED)
        assert fake.unregister_calls == unregistered  # the registrations are the parent's

    assert in_forked_child(child) == "ok"
    if state in ("ready", "pinning-background"):
        assert all(ptr in fake.registered for ptr in registered)  # the parent's pool is untouched
    pool.close(raise_errors=False)
    assert fake.registered == {}


# -- an interrupt at every step of entry ----------------------------------------------------------------


@needs_mlock
@pytest.mark.parametrize("step", ["claim", "scan", "map", "start", "views", "conductor"])
def test_an_interrupt_at_each_step_of_entry_leaves_nothing_behind(step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    before, claimed = vmlck_kb(), PINNED_RANGES.snapshot()
    tensor = pinpool.empty(8 * MiB) if step in ("claim", "scan") else None

    def interrupt(*_: Any, **__: Any) -> Any:
        raise KeyboardInterrupt(step)

    target: tuple[Any, str] = {
        "claim": (PINNED_RANGES, "add_all"),
        "scan": (MlockRuntime, "find_pinned"),
        "map": (HostMapping, "__init__"),
        "start": (PinSession, "__init__"),
        "views": (PoolMemory, "views"),
        "conductor": (Threads, "start"),
    }[step]
    background = step in ("views", "conductor")

    def make() -> pinpool.PinnedPool:
        if tensor is not None:
            return pinpool.pin(tensor, runtime="mlock", registry=None, name="entry")
        return pinpool.PinnedPool(size=8 * MiB, runtime="mlock", registry=None, name="entry", background=background)

    with monkeypatch.context() as patch:
        patch.setattr(*target, interrupt)
        pool = make()
        with pytest.raises(KeyboardInterrupt, match=step):
            pool.open()
    assert pool.state is PoolState.CLOSED
    assert PINNED_RANGES.snapshot() == claimed and vmlck_kb() == before
    again = make()  # the same memory (a pinned tensor) or a new mapping pins as usual afterwards
    with again:
        again.wait_ready_sync(timeout=30)
        assert again.state is PoolState.READY
    assert vmlck_kb() == before
