"""A Ctrl-C on every line: a deterministic sweep over pinpool's main-thread code.

For each scenario (a pool's whole life: enter, pin, body, teardown; foreground and background;
the sync, asyncio and trio drivers; ``open()``/``close()``; ``pinpool.pin()``; a pool over a
``SharedMemory`` it creates) a first run counts N ``line`` events of pinpool's own code on the
main thread (``sys.settrace``; worker threads are not traced, Python never delivers a signal
there). Then, for k in a sample of 1..N (every k with ``PINPOOL_TESTS=deep``, CI's deep step, or
``PINPOOL_KI_SWEEP=all``), the life is run again and at the k-th event the trace function sends a
**real SIGINT** (``signal.raise_signal``: the Python handler runs right there, as it would if
Ctrl-C arrived at that line; at the line event of a ``with`` statement's exit, where CPython never
runs a handler, it runs at the next place it would: see :func:`at_with_exit`). Afterwards:

* the run completed or a ``KeyboardInterrupt`` came out (never another error); in the sync and
  trio scenarios a sent Ctrl-C always comes out (a deferred one is replayed, never lost), unless
  it landed in the finalizer of an earlier pool that the garbage collector ran meanwhile (its
  unpinning finishes, then the Ctrl-C is ignored, as Python ignores any exception a finalizer
  raises);
* SIGINT's handler is Python's own again and nothing is left deferred;
* ``close()`` from another thread returns (within 10 s, without an error);
* then nothing is registered in the runtime, no range is claimed, and ``PINNED_RANGES`` holds
  disjoint ranges (a Ctrl-C landing after ``__enter__`` has put the handler back,
  on its last lines, leaves a ready pool that the ``with`` statement never exits: like any pool
  not exited, ``close()`` unpins it, or its finalizer once it is collected);
* no pinpool thread is alive, and a new pool in the same process pins and unpins.

What this proves: a real Ctrl-C at any line of pinpool's main-thread code leaves nothing behind.
It does not model an *exception* raised at an arbitrary line inside a driver's guarded code (the
guard defers signals, not exceptions): raising ``KeyboardInterrupt`` from the trace function there
would model a bug, not a Ctrl-C. Where the guard is not installed (before it, after it, in the
safe wait) a raised exception and a real signal are the same thing, so this sweep covers them.
The process-wide book's own atomicity against an exception between two statements is tested
with a raise from the trace function in ``test_range_book.py``.
"""

from __future__ import annotations

import asyncio
import dis
import gc
import itertools
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
import torch
import trio

import pinpool
from pinpool._pin import finalize_lifecycle, guard_state
from pinpool._ranges import PINNED_RANGES
from pinpool.testing import FakeRegistrar, FakeRuntime

from ..depth import DEEP, depth

KiB = 1 << 10
CHUNK = 64 * KiB
CHUNKS = 8
PACKAGE = os.path.dirname(pinpool.__file__) + os.sep
ALL = os.environ.get("PINPOOL_KI_SWEEP") == "all" or DEEP
SAMPLES = 30  # per scenario in ./dev test; every k in the deep run


class Trace:
    """Counts line events in pinpool's code; at the ``at``-th, sends a real SIGINT (once)."""

    def __init__(self, at: int = 0) -> None:
        self.at = at
        self.count = 0
        self.fired = False
        self.pending = False  # sent at a with statement's exit: delivered where CPython would run the handler
        self.in_finalizer = False  # the Ctrl-C landed in a pool's finalizer, run by gc outside any driver

    def calls(self, frame: FrameType, event: str, arg: object) -> Any:
        if self.pending:  # a Python function's first instruction checks for signals (a Python __exit__'s too)
            self.send(frame)
        return self.lines if frame.f_code.co_filename.startswith(PACKAGE) else None

    def lines(self, frame: FrameType, event: str, arg: object) -> Any:
        if event == "line":
            self.count += 1
            if self.pending or (self.count == self.at and not at_with_exit(frame)):
                self.send(frame)
            elif self.count == self.at:
                self.pending = True
        return self.lines

    def send(self, frame: FrameType) -> None:
        self.pending, self.fired = False, True
        self.in_finalizer = guard_state()[0] == 0 and in_finalizer(frame)
        signal.raise_signal(signal.SIGINT)  # our handler defers it, or Python's raises here


_WITH_EXITS: dict[CodeType, frozenset[int]] = {}


def at_with_exit(frame: FrameType) -> bool:
    """Whether the frame is about to call a ``with`` statement's ``__exit__(None, None, None)``: the line event
    there is not a place a real signal lands. CPython runs signal handlers only at its eval-breaker checks
    (a function's first instruction, a backward jump, after a call returns), none of them between a with
    body's last instruction and the return of a C ``__exit__`` (a lock's): a Ctrl-C sent there is delivered
    at the next check, after a C ``__exit__`` returns or as a Python one starts (:meth:`Trace.calls`)."""
    code = frame.f_code
    exits = _WITH_EXITS.get(code)
    if exits is None:
        ops = [i for i in dis.get_instructions(code) if i.opname != "PRECALL"]
        exits = _WITH_EXITS[code] = frozenset(
            ops[n - 1].offset if n and ops[n - 1].opname == "SWAP" else ops[n].offset  # SWAP: the body returns
            for n in range(len(ops) - 4)
            if _calls_exit(ops[n : n + 5])
        )
    return frame.f_lasti in exits


def _calls_exit(ops: list[dis.Instruction]) -> bool:
    """``LOAD_CONST None`` three times, ``CALL 2``, ``POP_TOP``: a with statement's ``__exit__(None, None, None)``."""
    nones, (call, pop) = ops[:3], ops[3:]
    return all(op.opname == "LOAD_CONST" and op.argval is None for op in nones) and (
        call.opname == "CALL" and call.arg == 2 and pop.opname == "POP_TOP"
    )


def in_finalizer(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code is finalize_lifecycle.__code__:
            return True
        frame = frame.f_back
    return False


def small_pool(runtime: FakeRuntime, **options: Any) -> pinpool.PinnedPool:
    return pinpool.PinnedPool(
        size=CHUNKS * CHUNK, chunk_bytes=CHUNK, runtime=runtime, registry=None, register_workers=2,
        populate_workers=2, unpin_workers=2, **options,
    )  # fmt: skip


# -- the lives: build what is not traced (options, plan), then run the traced part ----------------


def with_block(pool: pinpool.PinnedPool, background: bool) -> Callable[[], None]:
    """The traced part of a sync life: the ``with`` block, its body waiting for a background pool."""

    def run() -> None:
        with pool:
            if background:
                pool.wait_ready_sync()
            pool.tensor[:1].fill_(1)

    return run


def life_sync(pools: list[pinpool.PinnedPool], runtime: FakeRuntime, background: bool) -> Callable[[], None]:
    pool = small_pool(runtime, background=background)
    pools.append(pool)

    return with_block(pool, background)


def life_open_close(pools: list[pinpool.PinnedPool], runtime: FakeRuntime, background: bool) -> Callable[[], None]:
    pool = small_pool(runtime, background=background)
    pools.append(pool)

    def run() -> None:
        pool.open()
        pool.close()

    return run


def life_async(backend: str) -> Callable[[list[pinpool.PinnedPool], FakeRuntime, bool], Callable[[], None]]:
    def life(pools: list[pinpool.PinnedPool], runtime: FakeRuntime, background: bool) -> Callable[[], None]:
        pool = small_pool(runtime, background=background)
        pools.append(pool)

        async def body() -> None:
            async with pool:
                if background:
                    await pool.wait_ready()
                pool.tensor[:1].fill_(1)

        if backend == "trio":
            return lambda: trio.run(body)
        return lambda: asyncio.run(body())

    return life


def life_pin(pools: list[pinpool.PinnedPool], runtime: FakeRuntime, background: bool) -> Callable[[], None]:
    tensor = pinpool.empty(CHUNKS * CHUNK, dtype=torch.uint8)
    pool = pinpool.pin(tensor, runtime=runtime, registry=None, chunk_bytes=CHUNK, background=background)
    pools.append(pool)

    return with_block(pool, background)


def life_registrar(backend: str | None) -> Callable[[list[pinpool.PinnedPool], FakeRuntime, bool], Callable[[], None]]:
    """A pool that registers with two transfer engines besides the runtime (sync, or an async driver)."""

    def life(pools: list[pinpool.PinnedPool], runtime: FakeRuntime, background: bool) -> Callable[[], None]:
        engines = [FakeRegistrar("one"), FakeRegistrar("two", preferred_bytes=2 * CHUNK)]
        REGISTRARS.extend(engines)
        pool = small_pool(runtime, background=background, registrars=engines)
        pools.append(pool)
        if backend is None:
            return with_block(pool, background)

        async def body() -> None:
            async with pool:
                if background:
                    await pool.wait_ready()
                pool.transfer_pieces("two", pages=range(0, 1))

        return (lambda: trio.run(body)) if backend == "trio" else (lambda: asyncio.run(body()))

    return life


REGISTRARS: list[FakeRegistrar] = []  # the engines of the life being run: they must hold nothing after it


def life_shared(pools: list[pinpool.PinnedPool], runtime: FakeRuntime, background: bool) -> Callable[[], None]:
    where = Path(tempfile.mkdtemp(prefix="pinpool-ki-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    shared = pinpool.SharedMemory(where / "kv")
    pool = small_pool(runtime, background=background, memory=shared)
    pools.append(pool)

    return with_block(pool, background)


def life_elastic(pools: list[pinpool.PinnedPool], runtime: FakeRuntime, background: bool) -> Callable[[], None]:
    """An elastic pool: a floor of 2 chunks of 8 reserved, grown by a segment and shrunk by it in the body."""
    pool = pinpool.PinnedPool(
        size=2 * CHUNK, reserve=CHUNKS * CHUNK, grow_step=2 * CHUNK, chunk_bytes=CHUNK, runtime=runtime,
        registry=None, register_workers=2, populate_workers=2, unpin_workers=2, background=background,
    )  # fmt: skip
    pools.append(pool)

    def run() -> None:
        with pool:
            if background:
                pool.wait_ready_sync()
            pool.grow_sync(pages=2 * CHUNK)
            pool.tensor[2 * CHUNK : 3 * CHUNK].fill_(1)
            pool.shrink_sync(to_pages=2 * CHUNK)

    return run


SCENARIOS: dict[str, tuple[Callable[..., Callable[[], None]], bool]] = {
    "sync": (life_sync, False),
    "sync-background": (life_sync, True),
    "open-close": (life_open_close, False),
    "open-close-background": (life_open_close, True),
    "asyncio": (life_async("asyncio"), False),
    "asyncio-background": (life_async("asyncio"), True),
    "trio": (life_async("trio"), False),
    "trio-background": (life_async("trio"), True),
    "pin": (life_pin, False),
    "pin-background": (life_pin, True),
    "shared-memory": (life_shared, False),
    "registrars": (life_registrar(None), False),
    "registrars-trio-background": (life_registrar("trio"), True),
    "elastic": (life_elastic, False),
}


def pinpool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pinpool-")]


def run_once(scenario: str, at: int) -> tuple[Trace, BaseException | None]:
    """One traced life with a Ctrl-C at line event ``at`` (0: none), then every check."""
    make, background = SCENARIOS[scenario]
    runtime = FakeRuntime()
    pools: list[pinpool.PinnedPool] = []
    REGISTRARS.clear()
    claims_before = PINNED_RANGES.snapshot()
    run = make(pools, runtime, background)
    trace = Trace(at)
    outcome: BaseException | None = None
    # A pool of an earlier life collected now, not while this one is traced: its finalizer would shift
    # this life's line events (event k would be other code than in the counting run).
    gc.collect()
    previous = sys.gettrace()  # coverage's tracer, under --cov: put back, or the worker stops measuring
    sys.settrace(trace.calls)
    try:
        run()
    except BaseException as exc:
        outcome = exc
    finally:
        sys.settrace(previous)
    where = f"{scenario}, Ctrl-C at line event {at} of {trace.count}"
    assert outcome is None or isinstance(outcome, KeyboardInterrupt), f"{where}: {outcome!r}"
    # asyncio.run may absorb a late cancel; a finalizer's Ctrl-C is ignored, as Python ignores what one raises
    if trace.fired and not scenario.startswith("asyncio") and not trace.in_finalizer:
        assert isinstance(outcome, KeyboardInterrupt), f"{where}: the Ctrl-C was lost"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, where
    assert guard_state() == (0, 0), where

    errors: list[BaseException] = []

    def close_all() -> None:
        for pool in pools:
            try:
                pool.close()
            except BaseException as exc:
                errors.append(exc)

    closer = threading.Thread(target=close_all, name="ki-sweep-close")
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), f"{where}: close() from another thread hangs"
    assert errors == [], f"{where}: close() raised {errors!r}"
    assert runtime.registered == {}, f"{where}: left registered"
    assert all(engine.registered == {} for engine in REGISTRARS), f"{where}: left registered with an engine"
    assert PINNED_RANGES.snapshot() == claims_before, f"{where}: a range claim left behind"
    ranges = sorted(PINNED_RANGES.snapshot().items())
    assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(ranges)), where
    deadline = time.monotonic() + 5
    while pinpool_threads() and time.monotonic() < deadline:
        time.sleep(0.002)
    assert pinpool_threads() == [], f"{where}: a pinpool thread is still alive"
    return trace, outcome


def a_new_pool_works() -> None:
    runtime = FakeRuntime()
    pool = pinpool.PinnedPool(size=2 * CHUNK, chunk_bytes=CHUNK, runtime=runtime, registry=None, populate_workers=1)
    with pool:
        assert runtime.registered and pool.pinned_pages == pool.num_pages
    assert runtime.registered == {}


def sample(n: int, scenario: str) -> list[int]:
    if ALL or n <= SAMPLES:
        return list(range(1, n + 1))
    picked = set(random.Random(f"{scenario}-{n}").sample(range(1, n + 1), SAMPLES - 2))
    return sorted(picked | {1, n})


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """What exists before the sweep, frozen out of the collector: each life's ``gc.collect()`` then
    scans only what the lives made (a full collection with torch loaded took ~30 ms a life)."""
    gc.collect()  # nothing of earlier tests is frozen unfinalized
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@depth
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_ctrl_c_on_any_line_leaves_nothing_behind(scenario: str, frozen_heap: None) -> None:
    # A life's length varies with its waits' polls (a loaded machine polls more): sample within the
    # shortest of three, so a Ctrl-C meant for a line is not sent past the end of a shorter life.
    counts = []
    for _ in range(3):
        counted, outcome = run_once(scenario, at=0)
        assert outcome is None and counted.count > 50, counted.count  # the life ran, and was traced
        counts.append(counted.count)
    ks = sample(min(counts), scenario)
    fired = 0
    for k in ks:
        trace, _ = run_once(scenario, at=k)
        fired += trace.fired  # not when this run's life was shorter (its waits poll): it completed
        a_new_pool_works()
    assert fired >= 0.9 * len(ks), (fired, len(ks))


def test_a_ctrl_c_sent_at_a_with_exit_arrives_once_the_lock_is_released() -> None:
    """The one place the sweep does not raise at the line it counts: a signal sent as a ``with lock:`` body
    ends is delivered at the next line (CPython runs no handler before a C ``__exit__`` returns), so the
    lock is free; at every other line the Ctrl-C raises right there, in the with body included."""
    lock = threading.Lock()

    def reads(d: dict[int, int]) -> dict[int, int]:
        with lock:
            return {k: 2 * v for k, v in d.items()}

    def caller(d: dict[int, int]) -> dict[int, int]:
        read = reads(d)
        return read

    def under(trace: Trace) -> BaseException | None:
        def calls(frame: FrameType, event: str, arg: object) -> Any:
            return (
                trace.calls(frame, event, arg)
                if frame.f_code in (caller.__code__, reads.__code__, *comprehensions)
                else None
            )

        sys.settrace(calls)
        try:
            caller({1: 2, 3: 4})
        except KeyboardInterrupt as exc:
            return exc
        finally:
            sys.settrace(None)
        return None

    comprehensions = [c for c in reads.__code__.co_consts if isinstance(c, type(reads.__code__))]
    global PACKAGE
    saved, PACKAGE = PACKAGE, ""  # every frame's line events count here
    try:
        counted = Trace()
        assert under(counted) is None and counted.count >= 4
        raised = 0
        for at in range(1, counted.count + 1):
            trace = Trace(at)
            raised += isinstance(under(trace), KeyboardInterrupt)
            assert not lock.locked(), f"Ctrl-C at line event {at} of {counted.count} left the lock held"
            assert trace.fired
    finally:
        PACKAGE = saved
    assert raised == counted.count  # none lost: the deferred one arrives at the caller's next line
