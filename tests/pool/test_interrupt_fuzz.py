"""Interrupt fuzz: hypothesis picks the moment (before or after any runtime call) and the kind of
interruption, for all three drivers, with pools pinned before the body or in the background;
afterwards nothing may be registered, no range claimed,
the pool closed, no pinpool thread alive, and the right exception must come out.

``PINPOOL_FUZZ_EXAMPLES`` raises the example count (CI runs the default).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anyio
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pinpool
from pinpool._ranges import PINNED_RANGES
from pinpool.testing import FakeRegistrar, FakeRuntime, assert_released

from ..conftest import lifecycle_of
from ..depth import depth, runs

MiB = 1 << 20
EXAMPLES = runs(20, 40, "PINPOOL_FUZZ_EXAMPLES")  # more for a deeper search
CHUNKS = 12


@dataclass(frozen=True)
class Moment:
    op: str  # "populate" | "register" | "unregister"
    call: int  # 1-based call number of that op
    when: str  # "before" | "after" the call


class Trap(FakeRuntime):
    """FakeRuntime that fires ``fire()`` once, before or after the chosen call (through its call hooks)."""

    def __init__(self, moment: Moment, fire: Callable[[], None], **kwargs: object) -> None:
        super().__init__(
            before_call=lambda op, _ptr, _nbytes: self._at(op, "before"),
            after_call=lambda op, _ptr, _nbytes: self._at(op, "after"), **kwargs,  # type: ignore[arg-type]
        )  # fmt: skip
        self.moment = moment
        self._fire = fire
        self.fired = threading.Event()
        self._counts = dict.fromkeys(["populate", "register", "unregister", "engine-register", "engine-unregister"], 0)
        self.engines: list[FakeRegistrar] = []  # the pool's transfer registrars: they must hold nothing after it
        self._count_lock = threading.Lock()
        self.claims_before = PINNED_RANGES.snapshot()  # other tests' deliberate leaks stay claimed

    def _at(self, op: str, when: str) -> None:
        with self._count_lock:
            if when == "before":
                self._counts[op] += 1
            hit = (op, self._counts[op], when) == (self.moment.op, self.moment.call, self.moment.when)
        if hit and not self.fired.is_set():
            self.fired.set()
            self._fire()


moments = st.builds(
    Moment,
    op=st.sampled_from(["populate", "register", "unregister", "engine-register", "engine-unregister"]),
    call=st.integers(1, CHUNKS),
    when=st.sampled_from(["before", "after"]),
)
pool_shapes = st.fixed_dictionaries(
    {
        "register_workers": st.integers(1, 3),
        "populate_workers": st.integers(1, 3),
        "unpin_workers": st.integers(1, 3),
        "lock_on_fault": st.booleans(),
        "populate": st.booleans(),
        "delay": st.sampled_from([0.0, 0.0005, 0.002]),
        "background": st.booleans(),  # the body runs while a conductor thread pins
        "registrars": st.integers(0, 2),  # transfer engines registering the pool too (their calls are moments)
    }
)


# The pool's memory, held from the moment an interrupt is fired until drain() is done: otherwise
# its unmap finalizer can run inside the interrupt window, and a late Ctrl-C landing in that
# finalizer is swallowed by Python as an "exception ignored" (a harness artefact, not a leak).
KEPT: list[object] = []


def make_pool(shape: dict[str, object], moment: Moment, fire: Callable[[], None]) -> tuple[pinpool.PinnedPool, Trap]:
    delay = shape["delay"]

    def keep_then_fire() -> None:
        KEPT.append(lifecycle_of(pool).memory)
        fire()

    fake = Trap(
        moment, keep_then_fire, register_delay=delay, unregister_delay=delay, populate_delay=delay,
        lock_on_fault=shape["lock_on_fault"],
    )  # fmt: skip

    def at_engine_call(op: str, ptr: int, nbytes: int) -> None:
        fake._at(f"engine-{op}", "before")
        fake._at(f"engine-{op}", "after")

    fake.engines = [
        FakeRegistrar(f"engine{k}", preferred_bytes=(k + 1) * MiB, register_delay=delay, before_call=at_engine_call)
        for k in range(shape.get("registrars", 0))  # type: ignore[call-overload]
    ]  # fmt: skip
    pool = pinpool.PinnedPool(
        size=CHUNKS * MiB, chunk_bytes=MiB, runtime=fake, registry=None, populate=shape["populate"],
        register_workers=shape["register_workers"], populate_workers=shape["populate_workers"],
        unpin_workers=shape["unpin_workers"], background=shape["background"], registrars=fake.engines,
    )  # fmt: skip
    return pool, fake


def released(pool: pinpool.PinnedPool, fake: Trap) -> None:
    """assert_released, and every transfer engine holds nothing."""
    assert_released(pool, fake, claims_before=fake.claims_before)
    assert all(engine.registered == {} for engine in fake.engines), [e.registered for e in fake.engines]


def signal_main(signum: int = signal.SIGINT) -> None:
    """A real signal to the main thread, as Ctrl-C or `kill` would send (it interrupts blocking waits)."""
    main = threading.main_thread().ident
    assert main is not None
    signal.pthread_kill(main, signum)


def ctrl_c(twice: bool) -> None:
    """One Ctrl-C, or two a millisecond apart."""
    signal_main()
    if twice:
        time.sleep(0.001)
        signal_main()


def drain(caught: list[BaseException], seconds: float = 0.1) -> None:
    """Let interrupts still on their way land here, recorded, instead of in pytest; then let the
    memory kept since the interrupt go."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            time.sleep(0.002)
        except BaseException as exc:
            caught.append(exc)
    KEPT.clear()


@pytest.fixture
def sigterm_raises_system_exit() -> Iterator[None]:
    def handler(signum: int, frame: object) -> None:
        raise SystemExit(143)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


fuzz = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], database=None
)


# -- sync driver: KeyboardInterrupt (once or twice) and SystemExit, as real signals to the main thread ------


@depth
@fuzz
@given(moment=moments, shape=pool_shapes, kind=st.sampled_from(["ki", "ki2", "system_exit"]))
def test_sync_driver(moment: Moment, shape: dict[str, object], kind: str, sigterm_raises_system_exit: None) -> None:
    def fire() -> None:
        if kind == "system_exit":
            signal_main(signal.SIGTERM)
            return
        ctrl_c(twice=kind == "ki2")

    pool, fake = make_pool(shape, moment, fire)
    expected = SystemExit if kind == "system_exit" else KeyboardInterrupt
    caught: list[BaseException] = []
    try:
        with pool:
            time.sleep(0.005)
    except BaseException as exc:
        caught.append(exc)
    drain(caught)
    if fake.fired.is_set():
        assert caught and isinstance(caught[0], expected), caught
    released(pool, fake)


# -- asyncio: Task.cancel() once or twice, asyncio.timeout, anyio cancel scope, Ctrl-C via asyncio.run ------


@depth
@fuzz
@given(
    moment=moments,
    shape=pool_shapes,
    kind=st.sampled_from(["cancel", "cancel2", "timeout", "anyio", "ki"]),
)
def test_asyncio_driver(moment: Moment, shape: dict[str, object], kind: str) -> None:
    outcome: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        scope = anyio.CancelScope()
        timeout = asyncio.timeout(None)

        def fire() -> None:
            if kind == "cancel":
                loop.call_soon_threadsafe(task.cancel)
            elif kind == "cancel2":
                loop.call_soon_threadsafe(task.cancel)
                loop.call_soon_threadsafe(task.cancel)
            elif kind == "timeout":
                loop.call_soon_threadsafe(lambda: timeout.reschedule(loop.time()))
            elif kind == "anyio":
                loop.call_soon_threadsafe(scope.cancel)
            else:
                signal_main()  # asyncio.run turns it into a cancel, then KeyboardInterrupt

        pool, fake = make_pool(shape, moment, fire)
        outcome.append("started")
        try:
            try:
                async with timeout:
                    with scope:
                        async with pool:
                            await asyncio.sleep(0.005)
                        await asyncio.sleep(0.05 if fake.fired.is_set() else 0)
            except TimeoutError:
                assert timeout.expired()
            outcome.append("timeout" if timeout.expired() else "scope" if scope.cancelled_caught else "normal")
        finally:
            released(pool, fake)
            outcome.append("books ok")

    caught: list[BaseException] = []
    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        outcome.append("cancelled")
    except KeyboardInterrupt:
        outcome.append("ki")
    drain(caught)
    assert caught == []
    assert "books ok" in outcome
    if kind == "timeout" and "normal" not in outcome:
        assert "timeout" in outcome
    if kind == "anyio" and "normal" not in outcome:
        assert "scope" in outcome
    if kind in ("cancel", "cancel2"):
        assert "normal" in outcome or "cancelled" in outcome
    if kind == "ki":
        assert "normal" in outcome or "ki" in outcome


# -- trio: cancel scopes and Ctrl-C (once or twice) -------------------------------------------------------


@depth
@fuzz
@given(moment=moments, shape=pool_shapes, kind=st.sampled_from(["cancel", "ki", "ki2"]))
def test_trio_driver(moment: Moment, shape: dict[str, object], kind: str) -> None:
    outcome: list[str] = []

    async def main() -> None:
        token = trio.lowlevel.current_trio_token()
        scope = trio.CancelScope()

        def fire() -> None:
            if kind == "cancel":
                token.run_sync_soon(scope.cancel)
                return
            ctrl_c(twice=kind == "ki2")

        pool, fake = make_pool(shape, moment, fire)
        try:
            with scope:
                async with pool:
                    await trio.sleep(0.005)
                await trio.sleep(0.05 if fake.fired.is_set() else 0)
            outcome.append("scope" if scope.cancelled_caught else "normal")
        finally:
            released(pool, fake)
            outcome.append("books ok")

    caught: list[BaseException] = []
    try:
        trio.run(main)
    except KeyboardInterrupt:
        outcome.append("ki")
    drain(caught)
    if kind == "ki2":
        outcome.extend("ki" for exc in caught if isinstance(exc, KeyboardInterrupt))
        caught = [exc for exc in caught if not isinstance(exc, KeyboardInterrupt)]
    assert caught == []
    assert "books ok" in outcome
    if kind == "cancel":
        assert "normal" in outcome or "scope" in outcome
    else:
        assert "normal" in outcome or "ki" in outcome
