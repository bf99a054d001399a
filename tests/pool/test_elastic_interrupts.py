"""Interrupting an elastic pool's grow or shrink: hypothesis picks the moment (before or after one of the
operation's runtime or engine calls); the sync driver gets a real Ctrl-C, asyncio a native Task.cancel, trio a
cancel scope's cancel, both from the thread making the call. Afterwards no usable page is unpinned (every page
of pinned_runs is registered with the runtime and every engine), and the pool's exit leaves nothing behind."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pinpool
from pinpool._ranges import PINNED_RANGES
from pinpool.testing import FakeRegistrar, FakeRuntime, assert_released

MiB = 1 << 20


@dataclass(frozen=True)
class Moment:
    action: str  # "grow" | "shrink"
    op: str  # "populate" | "register" | "unregister" | "engine"
    call: int  # 1-based, counted from the moment the action begins
    when: str  # "before" | "after"


class Trap(FakeRuntime):
    """A FakeRuntime that fires once, at the chosen call of the armed action (through its call hooks)."""

    def __init__(self, moment: Moment, **kwargs: object) -> None:
        super().__init__(
            before_call=lambda op, _ptr, _nbytes: self.at(op, "before"),
            after_call=lambda op, _ptr, _nbytes: self.at(op, "after"), **kwargs,  # type: ignore[arg-type]
        )  # fmt: skip
        self.moment, self.fire = moment, lambda: None
        self.armed, self.fired = False, threading.Event()
        self._counts: dict[str, int] = {}
        self._count_lock = threading.Lock()

    def at(self, op: str, when: str) -> None:
        with self._count_lock:
            if not self.armed:
                return
            if when == "before":
                self._counts[op] = self._counts.get(op, 0) + 1
            hit = (op, self._counts.get(op, 0), when) == (self.moment.op, self.moment.call, self.moment.when)
        if hit and not self.fired.is_set():
            self.fired.set()
            self.fire()


moments = st.builds(
    Moment,
    action=st.sampled_from(["grow", "shrink"]),
    op=st.sampled_from(["populate", "register", "unregister", "engine"]),
    call=st.integers(1, 6),
    when=st.sampled_from(["before", "after"]),
)
fuzz = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], database=None
)


def make(moment: Moment, engines: int) -> tuple[pinpool.PinnedPool, Trap, list[FakeRegistrar]]:
    fake = Trap(moment, register_delay=0.0005, unregister_delay=0.0005)

    def engine_call(op: str, ptr: int, nbytes: int) -> None:
        fake.at("engine", "before")
        fake.at("engine", "after")

    registrars = [FakeRegistrar(f"engine{k}", before_call=engine_call) for k in range(engines)]
    pool = pinpool.PinnedPool(
        size=2 * MiB, reserve=8 * MiB, grow_step=2 * MiB, chunk_bytes=MiB, runtime=fake, registry=None,
        registrars=registrars, name="elastic-fuzz",
    )  # fmt: skip
    return pool, fake, registrars


def usable_pages_are_pinned(pool: pinpool.PinnedPool, fake: Trap, engines: list[FakeRegistrar]) -> None:
    """No page the pool calls usable is unpinned: each is inside a runtime and every engine registration."""
    base = pool.data_ptr
    holders = [fake.registered, *(engine.registered for engine in engines)]
    for run in pool.pinned_runs:
        for page in (run.start, run.stop - 1):  # Raw: a page is a byte
            for held in holders:
                assert any(ptr <= base + page < ptr + n for ptr, n in held.items()), (page, held)


def checked_exit(pool: pinpool.PinnedPool, fake: Trap, engines: list[FakeRegistrar], claims: dict[int, int]) -> None:
    usable_pages_are_pinned(pool, fake, engines)
    pool.close()
    assert_released(pool, fake, claims_before=claims)
    assert all(engine.registered == {} for engine in engines)


def settle(caught: list[BaseException]) -> None:
    """Let a Ctrl-C still on its way land here rather than in pytest."""
    deadline = time.monotonic() + 0.05
    while time.monotonic() < deadline:
        try:
            time.sleep(0.002)
        except BaseException as exc:
            caught.append(exc)


@fuzz
@given(moment=moments, engines=st.integers(0, 1))
def test_ctrl_c_in_a_grow_or_shrink(moment: Moment, engines: int) -> None:
    claims = PINNED_RANGES.snapshot()
    pool, fake, registrars = make(moment, engines)
    main = threading.main_thread().ident
    assert main is not None
    fake.fire = lambda: signal.pthread_kill(main, signal.SIGINT)
    caught: list[BaseException] = []
    pool.open()
    try:
        if moment.action == "shrink":
            pool.grow_sync(pages=6 * MiB)
        fake.armed = True
        if moment.action == "grow":
            pool.grow_sync(pages=6 * MiB)
        else:
            pool.shrink_sync(to_pages=2 * MiB)
    except KeyboardInterrupt as exc:
        caught.append(exc)
    finally:
        fake.armed = False  # the exit's unregisters are no moment of the action
        settle(caught)
    assert fake.fired.is_set() == bool(caught)
    checked_exit(pool, fake, registrars, claims)


async def cancel_at_moment(moment: Moment, engines: int, backend: str) -> None:
    claims = PINNED_RANGES.snapshot()
    pool, fake, registrars = make(moment, engines)
    async with pool:
        if moment.action == "shrink":
            await pool.grow(pages=6 * MiB)
        cancelled = False
        if backend == "asyncio":
            loop = asyncio.get_running_loop()
            action = asyncio.ensure_future(
                pool.grow(pages=6 * MiB) if moment.action == "grow" else pool.shrink(to_pages=2 * MiB)
            )
            fake.fire = lambda: loop.call_soon_threadsafe(action.cancel)
            fake.armed = True
            try:
                await action
            except asyncio.CancelledError:
                cancelled = True
        else:
            token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                fake.fire = lambda: token.run_sync_soon(scope.cancel)
                fake.armed = True
                if moment.action == "grow":
                    await pool.grow(pages=6 * MiB)
                else:
                    await pool.shrink(to_pages=2 * MiB)
            cancelled = scope.cancelled_caught
        fake.armed = False
        if moment.action == "shrink" and cancelled:
            assert pool.pinned_runs == (range(0, 2 * MiB),)  # given up at once: never usable again
        await anyio.lowlevel.checkpoint()
        usable_pages_are_pinned(pool, fake, registrars)
    assert_released(pool, fake, claims_before=claims)
    assert all(engine.registered == {} for engine in registrars)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@fuzz
@given(moment=moments, engines=st.integers(0, 1))
def test_cancel_in_a_grow_or_shrink(moment: Moment, engines: int, backend: str) -> None:
    run: Callable[[], object] = lambda: anyio.run(cancel_at_moment, moment, engines, backend, backend=backend)  # noqa: E731
    run()
