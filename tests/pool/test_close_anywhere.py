"""``close()`` from anywhere, at any moment: other threads while the pool pins in the background,
while another thread opens it, and a signal handler (or another task of the event loop) on the
very thread that is already opening or closing it.

Issue 23, findings 4 and 5: a second ``close()`` raised ``PoolStateError`` ("being entered on
another thread") while another thread closed a background pool still pinning, even with
``raise_errors=False``, and so did a ``close()`` during ``open()``; a ``close()`` from a SIGTERM
handler on the thread already closing the pool waited for itself, for ever.
"""

from __future__ import annotations

import contextlib
import faulthandler
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import pinpool
from pinpool import PoolState, PoolStateError
from pinpool._ranges import PINNED_RANGES
from pinpool.testing import FakeRegistrar, FakeRuntime, assert_released, locked_bytes

from .. import preloaded
from ..conftest import needs_mlock
from .test_open_close import pool_of as owned_pool

MiB = 1 << 20
RUNS = 30


def pool_of(runtime: FakeRuntime | str, **kw: Any) -> pinpool.PinnedPool:
    return owned_pool(runtime, **{"size": 16 * MiB, "name": "closeany", **kw})


@pytest.fixture(autouse=True)
def _nothing_claimed() -> Iterator[None]:
    before = PINNED_RANGES.snapshot()
    yield
    assert PINNED_RANGES.snapshot() == before


def closers(pool: pinpool.PinnedPool, count: int, *, start: threading.Barrier | None = None) -> list[threading.Thread]:
    """``count`` threads that each close the pool (some as a destructor), recording what happened."""
    pool.outcomes = []  # type: ignore[attr-defined]
    barrier = start or threading.Barrier(count)

    def close(raise_errors: bool) -> None:
        barrier.wait(10)
        try:
            pool.outcomes.append(("returned", pool.close(raise_errors=raise_errors), pool.state))  # type: ignore[attr-defined]
        except BaseException as exc:
            pool.outcomes.append(("raised", exc, pool.state))  # type: ignore[attr-defined]

    threads = [threading.Thread(target=close, args=(i % 2 == 0,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads


def join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a close() never returned"


# -- finding 5: closes on many threads while a background pool pins --------------------------------


def test_closes_on_2_to_7_threads_while_a_background_pool_pins_all_return_and_nothing_stays() -> None:
    rng = random.Random(23)
    for run in range(RUNS):
        fake = FakeRuntime(register_delay=0.002, unregister_delay=rng.choice((0, 0.001)))
        pool = pool_of(fake, background=True, name=f"hammer{run}").open()
        time.sleep(rng.uniform(0, 0.01))
        count = rng.randint(2, 7)
        join_all(closers(pool, count))
        outcomes = pool.outcomes  # type: ignore[attr-defined]
        assert outcomes == [("returned", None, PoolState.CLOSED)] * count, (run, count, outcomes)
        assert fake.registered == {}, run
        assert sorted(fake.unregister_calls) == sorted(set(fake.unregister_calls)), "a chunk unregistered twice"


@needs_mlock
def test_closes_on_many_threads_of_a_real_mlock_background_pool_unlock_everything() -> None:
    baseline = locked_bytes()
    for run in range(4):
        pool = pool_of("mlock", background=True, size=64 * MiB, name=f"mlock{run}", unpin_workers=2).open()
        time.sleep(0.002 * run)
        join_all(closers(pool, 2 + run))
        outcomes = pool.outcomes  # type: ignore[attr-defined]
        assert [o[0] for o in outcomes] == ["returned"] * (2 + run), outcomes
        assert pool.state is PoolState.CLOSED and pool.registrations == ()
        assert locked_bytes() == baseline


# -- finding 5: close() racing open() ------------------------------------------------------------


def start_opening(pool: pinpool.PinnedPool) -> tuple[threading.Thread, list[object]]:
    """A thread calling ``pool.open()``, and the list that gets what it returned or raised."""
    result: list[object] = []

    def open_it() -> None:
        try:
            result.append(pool.open())
        except BaseException as exc:
            result.append(exc)

    opener = threading.Thread(target=open_it)
    opener.start()
    return opener, result


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_close_racing_open_never_raises_and_leaves_nothing(background: bool) -> None:
    rng = random.Random(5)
    opened = closed_during = 0
    for run in range(RUNS):
        fake = FakeRuntime(register_delay=0.002)
        pool = pool_of(fake, background=background, name=f"race{run}")
        opener, result = start_opening(pool)
        # A background open() returns once pinning has started (~1 ms): the closes must come soon.
        time.sleep(rng.uniform(0, 0.003 if background else 0.04))
        threads = closers(pool, rng.randint(1, 3))
        join_all([*threads, opener])
        outcomes = pool.outcomes  # type: ignore[attr-defined]
        assert all(o[0] == "returned" and o[1] is None for o in outcomes), (run, outcomes)
        assert pool.state is PoolState.CLOSED and fake.registered == {}, run
        if result[0] is pool:
            opened += 1
        else:
            assert isinstance(result[0], PoolStateError), result
            closed_during += "closed while it was being opened" in str(result[0])
    assert closed_during > 0, "no close landed during open(): the race is not exercised"


@needs_mlock
@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_close_racing_open_of_a_real_mlock_pool_unlocks_everything(background: bool) -> None:
    baseline = locked_bytes()
    for run in range(4):
        pool = pool_of("mlock", background=background, size=64 * MiB, name=f"mlockrace{run}", unpin_workers=2)
        opener, result = start_opening(pool)
        time.sleep(0.001 * run)
        join_all([*closers(pool, 2), opener])
        assert [o[0:2] for o in pool.outcomes] == [("returned", None)] * 2, pool.outcomes  # type: ignore[attr-defined]
        assert result[0] is pool or isinstance(result[0], PoolStateError), result
        assert pool.state is PoolState.CLOSED and pool.registrations == ()
        assert locked_bytes() == baseline


def test_a_close_during_open_stops_pinning_and_open_raises_a_pool_state_error() -> None:
    fake = FakeRuntime(register_delay=0.005)  # 64 chunks: 0.3 s; a close stops pinning within ~0.1 s
    pool = pool_of(fake, size=64 * MiB)
    closer: list[threading.Thread] = []

    def close_on_another_thread(op: str, ptr: int, nbytes: int) -> None:
        if op == "register" and not closer:
            closer.append(threading.Thread(target=lambda: pool.close(raise_errors=False)))
            closer[0].start()

    fake.after_call = close_on_another_thread
    with pytest.raises(PoolStateError, match="closed while it was being opened") as raised:
        pool.open()
    join_all(closer)
    assert pool.state is PoolState.CLOSED and fake.registered == {}
    assert len(fake.register_calls) < 64, "the close did not stop the pinning"
    assert "close()" in str(raised.value)


def test_close_inside_the_body_then_the_with_exit_is_a_no_op(fake: FakeRuntime) -> None:
    with pool_of(fake) as pool:
        assert pool.close() is None and pool.state is PoolState.CLOSED
    assert fake.registered == {} and len(fake.unregister_calls) == 16


def test_exit_while_another_thread_stops_a_background_pinning_waits_instead_of_raising(fake: FakeRuntime) -> None:
    pool = pool_of(fake, background=True)
    in_register, release = threading.Event(), threading.Event()

    def hold_a_register(op: str, ptr: int, nbytes: int) -> None:
        if op == "register" and len(fake.register_calls) == 3:
            in_register.set()
            release.wait(10)

    fake.before_call = hold_a_register
    pool.open()
    assert in_register.wait(10)
    closer = threading.Thread(target=pool.close)
    closer.start()
    time.sleep(0.05)  # the closer now waits for the conductor's call in flight: the pool is still pinning
    assert pool.state is PoolState.PINNING
    threading.Timer(0.1, release.set).start()
    pool.__exit__(None, None, None)  # the with-exit of the thread that entered: waits for the closer
    join_all([closer])
    assert pool.state is PoolState.CLOSED and fake.registered == {}


# -- finding 4: close() from a signal handler on the thread already closing --------------------------

CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    import pinpool, trio
    from pinpool._ranges import PINNED_RANGES
    from pinpool.testing import FakeRuntime

    mode = sys.argv[1]
    sent = []

    def kill_once(op, ptr, nbytes):
        # The signal lands while the main thread waits in the teardown (or, mode open, in the pinning).
        if op == ("register" if mode == "open" else "unregister") and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)

    fake = FakeRuntime(after_call=kill_once, unregister_delay=0.01, register_delay=0.002)
    pool = pinpool.PinnedPool(size="16MiB", chunk_bytes="1MiB", runtime=fake, registry=None, populate=False,
                              register_workers=1, unpin_workers=1)
    handled = []

    def handler(*_):
        handled.append(repr(pool.close()))

    async def body(sleep):
        async with pool:
            await sleep(0.01)

    if mode in ("sync", "open"):
        signal.signal(signal.SIGTERM, handler)
        try:
            if mode == "sync":
                with pool:
                    pass
            else:
                pool.open()
        except pinpool.PoolStateError as exc:
            handled.append(type(exc).__name__ + ": " + str(exc))
        finally:
            pool.close()  # what servers write
    elif mode == "asyncio":
        async def main():
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, handler)
            await body(asyncio.sleep)
        asyncio.run(main())
    else:  # trio: a task that receives the signal and closes the pool
        async def main():
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                async with trio.open_nursery() as nursery:
                    async def watch():
                        async for _ in signals:
                            handler()
                            return
                    nursery.start_soon(watch)
                    await body(trio.sleep)
        trio.run(main)
    print("handled", handled, "state", pool.state.value, "registered", len(fake.registered),
          "claimed", len(PINNED_RANGES.snapshot()), flush=True)
    """
)


@pytest.mark.parametrize("mode", ["sync", "asyncio", "trio", "open"])
def test_close_from_a_signal_handler_on_the_thread_that_is_closing_returns(mode: str) -> None:
    try:
        child = preloaded.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"{mode}: close() from the signal handler hung the process: {hung.stdout!r} {hung.stderr!r}")
    assert child.returncode == 0, child.stderr
    out = child.stdout
    assert "state closed registered 0 claimed 0" in out, out
    assert "handled ['None'" in out, out  # the handler ran, and its close returned None at once
    if mode == "open":
        assert "closed while it was being opened" in out, out


# -- close() inside a call pinpool makes on its own thread -------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "at"),
    [
        ("runtime", "register"), ("runtime", "unregister"), ("registrar", "register"), ("progress", "pinning"),
        ("grow-runtime", "register"), ("grow-registrar", "register"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_close_inside_a_call_on_pinpools_own_thread_returns_at_once(where: str, at: str, background: bool) -> None:
    """A runtime's, registrar's or on_progress callback's close() ran on a pin or unpin worker while the pool's
    driver waited for that worker: both waited for ever. Now it returns None at once, and the close runs on a
    thread of its own: the pool ends closed and nothing stays registered with either."""
    pool_box: list[pinpool.PinnedPool] = []
    closed: list[object] = []
    armed = threading.Event()
    if not where.startswith("grow"):
        armed.set()

    once = threading.Lock()  # workers call in parallel: one of them closes

    def close_once(op: str, *_: object) -> None:
        if op == at and armed.is_set() and once.acquire(blocking=False):
            closed.append(pool_box[0].close())

    on_worker = where.removeprefix("grow-")
    fake = FakeRuntime(before_call=close_once if on_worker == "runtime" else None)
    registrar = FakeRegistrar(before_call=close_once if on_worker == "registrar" else None)
    options: dict[str, Any] = {"registrars": [registrar], "background": background, "chunk_bytes": 2 * MiB}
    if where == "progress":
        options["on_progress"] = lambda *_: close_once("pinning")
    if where.startswith("grow"):
        options.update(size=4 * MiB, reserve=12 * MiB, grow_step=4 * MiB)
    pool = pool_of(fake, **options)
    pool_box.append(pool)
    faulthandler.dump_traceback_later(60, exit=True)  # a regression hangs
    try:
        with contextlib.suppress(PoolStateError):
            with pool:
                if background:
                    pool.wait_ready_sync()
                armed.set()
                if where.startswith("grow"):
                    pool.grow_sync(pages=1)
    finally:
        faulthandler.cancel_dump_traceback_later()
    if where == "progress" and not background:
        assert closed == [None] or closed == []  # a foreground pool's progress runs on the caller's own thread
    else:
        assert closed == [None], "the hook never closed the pool"
    assert_released(pool, fake)
    assert registrar.registered == {}


def test_close_of_another_pool_inside_a_call_on_a_worker_runs_there() -> None:
    """Only the pool whose driver waits for the worker is closed on a thread of its own: another pool's close()
    in the same call runs right there and returns once that pool is closed (it returned at once, still closing)."""
    other_fake = FakeRuntime()
    other = pool_of(other_fake, name="other")
    seen: list[object] = []

    def close_other(op: str, *_: object) -> None:
        if op == "register" and not seen:
            seen.extend((other.close(), other.state, dict(other_fake.registered)))

    other.open()
    fake = FakeRuntime(before_call=close_other)
    with pool_of(fake, chunk_bytes=4 * MiB, register_workers=1) as pool:
        assert pool.state is PoolState.READY
    assert seen == [None, PoolState.CLOSED, {}]
    assert_released(other, other_fake)
    assert_released(pool, fake)


# The finalizer at interpreter exit unpins a pool its runtime's hook keeps alive; the hook closes the pool from
# inside the finalizer's unregister call (on the finalizer's own thread, the main one at exit).
CLOSE_IN_FINALIZER = """
import sys, warnings
import pinpool
from pinpool.testing import FakeRuntime
warnings.simplefilter("ignore")
box = []
def hook(op, *_):
    if op == "unregister" and len(box) == 1:
        box.append(box[0].close(raise_errors=False))
        print("close returned", box[1], flush=True)
fake = FakeRuntime(before_call=hook)
box.append(pinpool.PinnedPool(size=4 << 20, chunk_bytes=1 << 20, runtime=fake, registry=None, name="fin"))
box[0].open()
print("left open", flush=True)
"""


def test_close_inside_the_finalizers_runtime_call_returns() -> None:
    """The finalizer drove the teardown inline and its runtime's hook called close(), which waited for the
    finalizer to let go of the pool: for ever. It returns None at once now, and the finalizer ends the pool."""
    child = preloaded.run([sys.executable, "-c", CLOSE_IN_FINALIZER], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == ["left open", "close returned None"]
