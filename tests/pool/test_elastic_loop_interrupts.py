"""The pool's exit while its policy loop grows or shrinks on its own thread: ``close()`` from the body's thread,
from another thread and from the event loop (asyncio, trio), a Ctrl-C in the body, a native ``Task.cancel()`` and a
trio cancellation of the body, and a real SIGINT to a child process. The moment is drawn (seeded) among the calls
of the loop's action: before or after one of a transfer engine's register or unregister calls, each held a random
few milliseconds. Afterwards the loop's thread is gone, VmLck is back (real mlock), the engine holds nothing and
no range claim is left."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anyio
import pytest
import trio

import pinpool
from pinpool._ranges import PINNED_RANGES
from pinpool.testing import FakePressure, FakeRegistrar, assert_released, locked_bytes

from .. import preloaded
from ..conftest import needs_mlock
from ..depth import deep_only, depth, runs
from .test_elastic_loop import CALM, PRESSED, Events, elastic_pool, loop_thread

MiB = 1 << 20
DEADLINE_S = 30.0  # for moments that come in milliseconds: only a hung loop reaches it
LIVES = runs(2, 12, "PINPOOL_LOOP_INTERRUPTS")
HOW = ["close-body", "close-thread", "ctrl-c", "close-asyncio", "close-trio", "cancel-asyncio", "cancel-trio"]


@dataclass(frozen=True)
class Moment:
    action: str  # "grow" (pool.want, calm) | "shrink" (pressure, on_give_up gives the tail)
    call: int  # the engine's call of the action (register for a grow, unregister for a shrink), 1-based
    when: str  # "before" | "after"
    hold: float  # seconds the call is held once the moment fired: the interruption lands inside the action

    @classmethod
    def draw(cls, rng: random.Random, action: str) -> Moment:
        return cls(action, rng.randint(1, 2), rng.choice(["before", "after"]), rng.choice([0.0, 0.002, 0.02]))


class Trap(FakeRegistrar):
    """A transfer engine that fires ``fire()`` once, at the moment, from the thread making its call (a segment is
    two chunks, one call each: ``max_bytes`` is a chunk)."""

    def __init__(self, moment: Moment) -> None:
        super().__init__("engine", max_bytes=MiB)
        self.moment = moment
        self.fire: Callable[[], object] = lambda: None
        self.armed, self.fired = False, threading.Event()
        self._calls = 0
        self._lock = threading.Lock()
        self._op = "register" if moment.action == "grow" else "unregister"

    def _at(self, op: str, when: str) -> None:
        with self._lock:
            if not self.armed or op != self._op:
                return
            self._calls += when == "before"
            hit = (self._calls, when) == (self.moment.call, self.moment.when)
        if hit and not self.fired.is_set():
            self.fired.set()
            self.fire()
            time.sleep(self.moment.hold)

    def register(self, ptr: int, nbytes: int) -> object:
        self._at("register", "before")
        try:
            return super().register(ptr, nbytes)
        finally:
            self._at("register", "after")

    def unregister(self, ptr: int, nbytes: int, handle: object) -> None:
        self._at("unregister", "before")
        try:
            super().unregister(ptr, nbytes, handle)
        finally:
            self._at("unregister", "after")


def make(events: Events, moment: Moment) -> tuple[pinpool.PinnedPool, FakePressure, Trap]:
    trap, pressure = Trap(moment), FakePressure()
    pool, _box = elastic_pool(events, pressure, options={"registrars": [trap]})
    return pool, pressure, trap


def start_action(pool: pinpool.PinnedPool, pressure: FakePressure, trap: Trap) -> None:
    """The loop's own action, armed (the floor and, for a shrink, three segments pinned before)."""
    trap.armed = True
    if trap.moment.action == "grow":
        pressure.set(CALM)
        pool.want(pages=MiB)
    else:
        pressure.set(PRESSED)


def prepare(pool: pinpool.PinnedPool, moment: Moment) -> None:
    if moment.action == "shrink":
        pool.grow_sync(nbytes=6 * MiB)  # on_give_up gives back a segment per reading


def wait(event: threading.Event) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not event.is_set():
        assert time.monotonic() < deadline, f"the moment never came within {DEADLINE_S} s"
        time.sleep(0.001)  # a sleep, not Event.wait: a Ctrl-C lands here at once


def left_nothing(pool: pinpool.PinnedPool, trap: Trap, claims: dict[int, int], locked: int) -> None:
    assert trap.fired.is_set()
    assert_released(pool, claims_before=claims, locked_before=locked)
    assert trap.registered == {}, trap.registered
    assert loop_thread() is None


@pytest.fixture
def events() -> Iterator[Events]:
    yield Events()
    assert loop_thread() is None, "a pool's policy loop outlived its pool"


def sync_life(how: str, moment: Moment, events: Events) -> None:
    claims, locked = PINNED_RANGES.snapshot(), locked_bytes()
    pool, pressure, trap = make(events, moment)
    caught: list[BaseException] = []
    if how == "close-thread":
        trap.fire = lambda: threading.Thread(target=pool.close, name="closer").start()
    elif how == "ctrl-c":
        main = threading.main_thread().ident
        assert main is not None
        trap.fire = lambda: signal.pthread_kill(main, signal.SIGINT)
    try:
        with pool:
            prepare(pool, moment)
            start_action(pool, pressure, trap)
            wait(trap.fired)
            if how == "close-body":
                pool.close()
            elif how == "ctrl-c":
                deadline = time.monotonic() + DEADLINE_S
                while time.monotonic() < deadline:
                    time.sleep(0.001)
                raise AssertionError("no Ctrl-C came")
            else:
                deadline = time.monotonic() + DEADLINE_S
                while pool.state is not pinpool.PoolState.CLOSED and time.monotonic() < deadline:
                    time.sleep(0.001)
    except KeyboardInterrupt as exc:
        caught.append(exc)
    assert (how == "ctrl-c") == bool(caught)
    left_nothing(pool, trap, claims, locked)


async def async_life(how: str, moment: Moment, events: Events) -> None:
    claims, locked = PINNED_RANGES.snapshot(), locked_bytes()
    pool, pressure, trap = make(events, moment)
    cancelled, done = False, anyio.Event()
    task = asyncio.current_task() if how.endswith("asyncio") else None
    on_loop: Callable[[Callable[[], object]], object] = (
        asyncio.get_running_loop().call_soon_threadsafe if task is not None
        else trio.lowlevel.current_trio_token().run_sync_soon
    )  # fmt: skip

    def close_on_loop() -> None:
        pool.close()  # on the event loop's thread, while the loop's own grow or shrink runs
        done.set()

    try:
        with anyio.CancelScope() as scope:
            if how == "cancel-asyncio":
                assert task is not None
                trap.fire = lambda: on_loop(task.cancel)
            elif how == "cancel-trio":
                trap.fire = lambda: on_loop(scope.cancel)
            else:
                trap.fire = lambda: on_loop(close_on_loop)
            async with pool:
                await anyio.to_thread.run_sync(prepare, pool, moment)
                start_action(pool, pressure, trap)
                await done.wait()
                assert how.startswith("close")
        cancelled = scope.cancelled_caught
    except asyncio.CancelledError:
        assert task is not None
        cancelled = True
        task.uncancel()
    assert cancelled == how.startswith("cancel")
    left_nothing(pool, trap, claims, locked)


def lives(how: str) -> list[Moment]:
    rng = random.Random(f"loop-interrupts-{how}")
    return [Moment.draw(rng, ("grow", "shrink")[life % 2]) for life in range(LIVES)]  # both, in the quick sample


@depth
@needs_mlock
@pytest.mark.parametrize("how", HOW)
def test_the_pools_exit_while_its_loop_grows_or_shrinks(how: str, events: Events) -> None:
    for moment in lives(how):
        events.seen.clear()
        try:
            if how.endswith("asyncio") or how.endswith("trio"):
                backend = "asyncio" if how.endswith("asyncio") else "trio"
                anyio.run(async_life, how, moment, events, backend=backend)
            else:
                sync_life(how, moment, events)
        except BaseException as exc:
            exc.add_note(f"life: {how} at {moment}")
            raise


# -- a real SIGINT to a child whose loop grows ------------------------------------------------------

# argv: the driver, the engine call to hold at (1-based register call of the loop's grow). The engine holds that
# call 200 ms after saying "moment": the parent's SIGINT lands while the loop's grow is under way.
CHILD = textwrap.dedent(
    """
    import asyncio, json, sys, threading, time
    import pinpool, trio
    from pinpool._host import libc as _libc
    from pinpool.testing import FakePressure, FakeRegistrar

    mode, hold_at = sys.argv[1], int(sys.argv[2])
    calls = []

    def before(op, ptr, nbytes):
        if op == "register" and armed:
            calls.append(ptr)
            if len(calls) == hold_at:
                print("moment", flush=True)
                time.sleep(0.2)

    armed = False
    engine = FakeRegistrar("engine", max_bytes=1 << 20, before_call=before)
    pressure = FakePressure()
    pressure.set(FakePressure.reading(0.0, used=1 << 30, limit=8 << 30))
    pool = pinpool.PinnedPool(
        size="4MiB", reserve="12MiB", grow_step="2MiB", chunk_bytes="1MiB", runtime="mlock", registry=None,
        registrars=[engine], elastic=pinpool.ElasticPolicy(step=4 << 20, cooldown_seconds=0.0), pressure=pressure,
        on_give_up=lambda nbytes: [], name="sigint",
    )

    def body():
        global armed
        armed = True
        pool.want(pages=4 << 20)
        print("ready", flush=True)

    async def body_async(sleep):
        async with pool:
            body()
            await sleep(30)

    caught = "-"
    try:
        if mode == "sync":
            with pool:
                body()
                time.sleep(30)
        elif mode == "trio":
            trio.run(body_async, trio.sleep)
        else:
            asyncio.run(body_async(asyncio.sleep))
    except BaseException as exc:
        caught = type(exc).__name__
    loops = [t.name for t in threading.enumerate() if t.name.startswith("pinpool-sigint")]
    print(json.dumps({"caught": caught, "vmlck": _libc.vm_locked_bytes(), "state": pool.state.value,
                      "threads": loops, "engine": len(engine.registered), "calls": len(calls)}), flush=True)
    """
)


@needs_mlock
@pytest.mark.parametrize(("mode", "twice"), [("sync", False), ("asyncio", False), ("trio", False), ("sync", True)])
def test_a_real_sigint_while_the_loop_grows(mode: str, twice: bool) -> None:
    """Once, or twice: the second while the exit waits for the loop's grow (held 200 ms by the engine)."""
    hold_at = random.Random(f"sigint-{mode}-{twice}").randint(1, 4)
    child = preloaded.spawn(
        [sys.executable, "-c", CHILD, mode, str(hold_at)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        lines = []
        for line in child.stdout:
            lines.append(line)
            if line == "moment\n":
                child.send_signal(signal.SIGINT)
                if twice:
                    time.sleep(0.05)
                    child.send_signal(signal.SIGINT)
                break
        out, err = child.communicate(timeout=60)
    finally:
        if child.returncode is None:
            child.kill()
            child.wait()
    assert "moment\n" in lines, (lines, out, err)
    report = json.loads(out.splitlines()[-1])
    assert report["caught"] == "KeyboardInterrupt", (report, err)
    assert report["vmlck"] == 0 and report["state"] == "closed" and report["engine"] == 0, (report, err)
    assert report["threads"] == [], report
    assert child.returncode == 0, err


@depth
@deep_only
@needs_mlock
def test_a_close_that_outwaits_the_loops_grow_takes_its_segment_over(events: Events) -> None:
    """The engine holds the loop's grow past the close's join (5 s): the close goes on without the loop, its
    teardown stops and rolls back the segment in flight, and the loop counts its grow as failed and ends."""
    claims, locked = PINNED_RANGES.snapshot(), locked_bytes()
    moment = Moment("grow", 1, "before", 6.0)
    pool, pressure, trap = make(events, moment)
    pool.open()
    start_action(pool, pressure, trap)
    wait(trap.fired)
    pool.close()
    left_nothing(pool, trap, claims, locked)
    assert events.named("elastic.stop_late")
    failed = events.wait("elastic.failed", kind="grow")
    assert "closed while it grew" in failed[0]["error"], failed
    assert events.named("elastic.stopped")


# A close() from a signal handler that lands while the main thread is inside want(), waking the loop: it used to
# deadlock on the loop's own lock (the handler's close woke the loop again). Run in a child: a regression hangs.
RINGING = textwrap.dedent(
    """
    import json, signal, threading, time
    import pinpool
    from pinpool.testing import FakePressure, FakeRuntime

    class Ringing(FakePressure):
        armed = False

        def wake(self):
            if self.armed and threading.current_thread() is threading.main_thread():
                self.armed = False
                signal.raise_signal(signal.SIGUSR1)  # its handler runs here, inside the loop's wake
            super().wake()

    pressure, fake = Ringing(), FakeRuntime()
    pool = pinpool.PinnedPool(
        size="4MiB", reserve="12MiB", grow_step="2MiB", chunk_bytes="1MiB", runtime=fake, registry=None,
        elastic=pinpool.ElasticPolicy(step=2 << 20), pressure=pressure, on_give_up=lambda n: [], name="ring",
    )
    signal.signal(signal.SIGUSR1, lambda *_: pool.close())
    pool.open()
    pool.grow_sync(nbytes="2MiB")
    pressure.armed = True
    pool.want(pages=1 << 20)
    deadline = time.monotonic() + 30
    while any(t.name.startswith("pinpool-ring") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    threads = [t.name for t in threading.enumerate() if t.name.startswith("pinpool-ring")]
    print(json.dumps({"state": pool.state.value, "threads": threads, "registered": len(fake.registered),
                      "closed": pressure.closed}))
    """
)


def test_a_close_from_a_signal_handler_inside_want() -> None:
    child = preloaded.run([sys.executable, "-c", RINGING], capture_output=True, text=True, timeout=30)
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.splitlines()[-1])
    assert report == {"state": "closed", "threads": [], "registered": 0, "closed": True}, (report, child.stderr)
