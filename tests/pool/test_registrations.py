"""pool.registrations: what the runtime has registered right now, one range per live call.

Checked against the runtime's own books (FakeRuntime.registered, MlockRuntime.registered) at
moments when no call is in flight: at the start of each call on the only worker, and from
another thread (a background pool's body, on_progress) while a worker is held at such a start.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import anyio
import pytest
import torch

import pinpool
from pinpool import layouts
from pinpool._pin import RegistrationBook
from pinpool._plan import Chunk, ChunkTable
from pinpool.runtimes import MlockRuntime
from pinpool.testing import FakeRuntime, locked_bytes

from ..conftest import each_driver, lifecycle_of, needs_mlock, pin_and_run

MiB = 1 << 20
pytestmark = pytest.mark.anyio


def books(registered: dict[int, int], base: int) -> list[tuple[int, int]]:
    """A runtime's books (base -> nbytes) as sorted (offset, nbytes) from the pool's start."""
    return sorted((ptr - base, nbytes) for ptr, nbytes in registered.items())


def listed(pool: pinpool.PinnedPool) -> list[tuple[int, int]]:
    regs = pool.registrations
    assert isinstance(regs, tuple) and all(isinstance(r, pinpool.Chunk) for r in regs)
    return [(r.offset, r.nbytes) for r in regs]


def assert_tiles(regs: list[tuple[int, int]], nbytes: int) -> None:
    """Sorted, back to back, covering [0, nbytes)."""
    end = 0
    for offset, size in regs:
        assert offset == end and size > 0, regs
        end += size
    assert end == nbytes, regs


class RateFake(FakeRuntime):
    """A fake driver that registers at ``bytes_per_second``: each call sleeps for its size (one
    register worker only: the delay is set per call)."""

    def __init__(self, bytes_per_second: float, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.rate = bytes_per_second

    def register(self, ptr: int, nbytes: int) -> None:
        self.register_delay = nbytes / self.rate
        super().register(ptr, nbytes)


class Holder:
    """A call hook that holds the worker at the start of chosen register calls until another
    thread has looked (:meth:`release`): a moment when the books must agree exactly."""

    def __init__(self, at: set[int]) -> None:
        self.at = at
        self.calls = 0
        self.held = threading.Event()
        self._go = threading.Event()

    def __call__(self, op: str, ptr: int, nbytes: int) -> None:
        if op != "register":
            return
        self.calls += 1
        if self.calls in self.at:
            self._go.clear()
            self.held.set()
            if not self._go.wait(30):
                raise AssertionError(f"register call {self.calls} was never released")

    def release(self) -> None:
        self.held.clear()
        self._go.set()


# -- the book itself (pure) ----------------------------------------------------------------------


def test_the_book_lists_whole_chunks_and_pieces_in_offset_order() -> None:
    chunks = ChunkTable([(0, 8, 4)])  # [0, 8), [8, 16), [16, 24), [24, 32)
    book = RegistrationBook(chunks)
    assert book.snapshot() == ()
    book.chunk_registered(3)
    book.registered(1, chunks[1], Chunk(12, 4))  # the second half of chunk 1 first (a retry's order may vary)
    book.registered(1, chunks[1], Chunk(8, 4))
    book.registered(0, chunks[0], Chunk(0, 8))  # a "piece" that is the whole chunk counts as the chunk
    book.chunk_registered(2)
    assert book.snapshot() == (Chunk(0, 8), Chunk(8, 4), Chunk(12, 4), Chunk(16, 8), Chunk(24, 8))
    book.unregistered(3, chunks[3], Chunk(24, 8))
    book.unregistered(1, chunks[1], Chunk(12, 4))
    book.unregistered(0, chunks[0], Chunk(0, 8))
    assert book.snapshot() == (Chunk(8, 4), Chunk(16, 8))
    book.unregistered(1, chunks[1], Chunk(8, 4))
    book.unregistered(2, chunks[2], Chunk(16, 8))
    assert book.snapshot() == ()


# -- equal to the runtime's books at every call ----------------------------------------------------


@each_driver
async def test_equal_to_the_fakes_books_at_every_call_and_it_shrinks_in_teardown(mode: str) -> None:
    """A stall budget (pieces) and a retry (halves), one worker per role: at the start of every
    register and unregister call nothing is in flight, so the books agree exactly."""
    fake = RateFake(2 << 30)  # 2 GiB/s
    fake.fail_next(1)  # the first call (chunk 0's first piece, 16 MiB) fails retryably: two halves
    pool = pinpool.PinnedPool(
        layout=layouts.Raw(granularity_bytes=MiB), size=64 * MiB, max_chunk_bytes=32 * MiB, runtime=fake,
        registry=None, populate=False, register_workers=1, unpin_workers=1, max_call_seconds=0.004,
        min_chunk_bytes=MiB,
    )  # fmt: skip
    assert pool.registrations == ()
    seen: list[tuple[str, int]] = []
    mismatches: list[object] = []

    def check(op: str, ptr: int, nbytes: int) -> None:
        base = fake.register_calls[0][0] if fake.register_calls else ptr  # one worker: chunk 0 comes first
        now, want = listed(pool), books(fake.registered, base)
        if now != want:
            mismatches.append((op, ptr - base, now, want))
        seen.append((op, len(now)))

    fake.before_call = check
    inside: list[list[tuple[int, int]]] = []

    def body(p: pinpool.PinnedPool) -> None:
        inside.append(listed(p))
        assert inside[0] == books(fake.registered, p.data_ptr)

    await pin_and_run(pool, mode, body)
    assert not mismatches, mismatches
    regs = inside[0]
    assert_tiles(regs, 64 * MiB)
    assert pool.stats.retries == 1
    assert regs[:2] == [(0, 8 * MiB), (8 * MiB, 8 * MiB)]  # the failed 16 MiB piece's halves
    assert len(regs) > len(pool.plan.chunks)  # the budget cut each chunk into several calls
    assert all(any(c.offset <= o and o + n <= c.end for c in pool.plan.chunks) for o, n in regs)
    # Teardown: one registration fewer at each unregister call, down to none.
    counts = [n for op, n in seen if op == "unregister"]
    assert counts == list(range(len(regs), 0, -1))
    assert pool.registrations == () and fake.registered == {}


async def test_lock_on_fault_chunks_are_listed_before_their_pages_fault() -> None:
    """mlock's order with the fake: each chunk is registered first, then its spans are faulted;
    when a span's faulting starts, the registration holding it is already listed."""
    fake = FakeRuntime(lock_on_fault=True)
    pool = pinpool.PinnedPool(
        size=64 * MiB, chunk_bytes=16 * MiB, runtime=fake, registry=None, register_workers=1, populate_workers=1,
        max_call_seconds=None,
    )  # fmt: skip
    assert pool.plan.order is pinpool._pin.pipeline.Order.REGISTER_FIRST
    uncovered: list[int] = []
    populates = 0

    def check(op: str, ptr: int, nbytes: int) -> None:
        nonlocal populates
        if op != "populate":
            return
        populates += 1
        base = fake.register_calls[0][0]
        offset = ptr - base
        if not any(r.offset <= offset and offset + nbytes <= r.end for r in pool.registrations):
            uncovered.append(offset)

    fake.before_call = check
    async with pool:
        assert listed(pool) == [(c.offset, c.nbytes) for c in pool.plan.chunks]
    assert populates >= 4 and not uncovered
    assert pool.registrations == ()


# -- read from another thread while pinning ----------------------------------------------------------


def background_pool() -> tuple[pinpool.PinnedPool, FakeRuntime, Holder]:
    holder = Holder(at={2, 4, 7})
    fake = RateFake(4 << 30, before_call=holder)
    pool = pinpool.PinnedPool(
        layout=layouts.Raw(granularity_bytes=MiB), size=96 * MiB, max_chunk_bytes=32 * MiB, runtime=fake,
        registry=None, populate=False, register_workers=1, background=True, max_call_seconds=0.004,
    )  # fmt: skip
    return pool, fake, holder


def sample_held(
    pool: pinpool.PinnedPool, fake: FakeRuntime, holder: Holder, samples: list[list[tuple[int, int]]]
) -> None:
    """From the body's thread: if the register worker is held, compare the books and let it go."""
    if holder.held.is_set():
        samples.append(listed(pool))
        assert samples[-1] == books(fake.registered, pool.data_ptr)
        holder.release()


def check_background_samples(
    pool: pinpool.PinnedPool, fake: FakeRuntime, samples: list[list[tuple[int, int]]], ready: list[tuple[int, int]]
) -> None:
    assert [len(s) for s in samples] == [1, 3, 6]  # held at calls 2, 4 and 7: 1, 3, 6 calls done
    assert all(s == ready[: len(s)] for s in samples)  # each one the start of what followed
    assert_tiles(ready, 96 * MiB)
    assert pool.registrations == () and fake.registered == {}


async def test_an_async_background_body_sees_exactly_the_fakes_books() -> None:
    pool, fake, holder = background_pool()
    samples: list[list[tuple[int, int]]] = []
    async with pool:
        while len(samples) < len(holder.at):
            sample_held(pool, fake, holder, samples)
            await anyio.sleep(0.001)
        await pool.wait_ready()
        ready = listed(pool)
        assert ready == books(fake.registered, pool.data_ptr)
    check_background_samples(pool, fake, samples, ready)


def test_a_sync_background_body_sees_exactly_the_fakes_books() -> None:
    pool, fake, holder = background_pool()
    samples: list[list[tuple[int, int]]] = []
    with pool:
        deadline = time.monotonic() + 30
        while len(samples) < len(holder.at) and time.monotonic() < deadline:
            sample_held(pool, fake, holder, samples)
            time.sleep(0.001)
        pool.wait_ready_sync(timeout=30)
        ready = listed(pool)
        assert ready == books(fake.registered, pool.data_ptr)
    check_background_samples(pool, fake, samples, ready)


@each_driver
async def test_on_progress_sees_exactly_the_fakes_books(mode: str) -> None:
    holder = Holder(at={2, 5})
    fake = RateFake(4 << 30, before_call=holder)
    samples: list[list[tuple[int, int]]] = []
    pool: pinpool.PinnedPool

    def progress(pinned: int, total: int, done: int, chunks: int) -> None:
        if holder.held.is_set():
            samples.append(listed(pool))
            assert samples[-1] == books(fake.registered, fake.register_calls[0][0])
            assert pinned == sum(n for _, n in samples[-1])  # the same calls, counted as pinned
            holder.release()

    pool = pinpool.PinnedPool(
        layout=layouts.Raw(granularity_bytes=MiB), size=64 * MiB, max_chunk_bytes=64 * MiB, runtime=fake,
        registry=None, populate=False, register_workers=1, max_call_seconds=0.004, on_progress=progress,
    )  # fmt: skip
    await pin_and_run(pool, mode, lambda p: samples.append(listed(p)))
    assert [len(s) for s in samples[:2]] == [1, 4]
    assert len(pool.plan.chunks) == 1 and len(samples[2]) > 1  # one chunk, several registrations
    assert_tiles(samples[2], 64 * MiB)
    assert pool.registrations == ()


async def test_a_concurrent_reader_never_sees_a_range_the_runtime_does_not_hold() -> None:
    """Several workers, no holding: a reader thread hammers the property through pinning and
    teardown. While pinning, what it lists the runtime holds (listed after its call returns);
    in teardown, what the runtime still holds is listed (removed after its call returns)."""
    fake = FakeRuntime(register_delay=0.0005, unregister_delay=0.0005)
    pool = pinpool.PinnedPool(
        size=64 * MiB, chunk_bytes=MiB, runtime=fake, registry=None, register_workers=2, populate_workers=2,
        unpin_workers=2, max_call_seconds=None,
    )  # fmt: skip
    stop = threading.Event()
    problems: list[str] = []
    phase = ["pinning"]
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            memory = lifecycle_of(pool).memory
            if memory is None:
                continue
            base, was = memory.address, phase[0]
            regs = listed(pool)
            after = set(books(fake.registered, base))
            if phase[0] != was:
                continue
            reads[0] += 1
            if any(a[0] + a[1] > b[0] for a, b in itertools.pairwise(regs)):
                problems.append(f"not sorted, or overlapping: {regs}")
            if was == "pinning" and not set(regs) <= after:  # booked once the call returned
                problems.append(f"pinning: listed {set(regs) - after}, not held")
            if was == "teardown" and not after <= set(regs):  # unbooked once the call returned
                problems.append(f"teardown: held {after - set(regs)}, not listed")

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        async with pool:
            phase[0] = "ready"
            assert listed(pool) == books(fake.registered, pool.data_ptr)
            assert len(pool.registrations) == 64
            phase[0] = "teardown"
        stop.set()
    finally:
        stop.set()
        thread.join(10)
    assert not problems, problems[:3]
    assert reads[0] > 10
    assert pool.registrations == ()


# -- failures: rollback, leaks -----------------------------------------------------------------------


@each_driver
async def test_a_rollback_removes_every_registration(mode: str) -> None:
    fake = FakeRuntime(fail_register_on=4)
    pool = pinpool.PinnedPool(
        size=8 * MiB, chunk_bytes=MiB, runtime=fake, registry=None, populate=False, register_workers=1,
        unpin_workers=1, max_retries=0,
    )  # fmt: skip
    during: list[bool | int] = []

    def check(op: str, ptr: int, nbytes: int) -> None:
        if op == "unregister":  # nothing in flight at the start of the only unpin worker's call
            during.append(listed(pool) == books(fake.registered, fake.register_calls[0][0]))
            during.append(len(pool.registrations))

    fake.before_call = check
    with pytest.raises(pinpool.PinError):
        await pin_and_run(pool, mode)
    assert during == [True, 3, True, 2, True, 1]  # three chunks registered before the failure, undone
    assert pool.registrations == () and fake.registered == {}


@pytest.mark.parametrize("budget", [None, 0.004])
def test_a_leaked_registration_stays_listed(budget: float | None) -> None:
    """An unregister that fails leaves the range with the runtime: it stays listed, as in the
    fake's books (with a budget the chunk is in pieces, and only the failed piece stays)."""
    fake = RateFake(4 << 30, fail_unregister_on=1)
    pool = pinpool.PinnedPool(
        layout=layouts.Raw(granularity_bytes=MiB), size=32 * MiB, max_chunk_bytes=16 * MiB, runtime=fake,
        registry=None, populate=False, register_workers=1, unpin_workers=1, max_call_seconds=budget,
    )  # fmt: skip
    base: list[int] = []
    with pytest.raises(pinpool.UnpinError) as info:
        with pool:
            base.append(pool.data_ptr)
            before = listed(pool)
    assert len(info.value.leaked) == 1
    leaked = info.value.leaked[0]
    after = listed(pool)
    assert after == books(fake.registered, base[0])
    assert after == [before[-1]]  # the highest registration is unregistered first, and failed
    assert leaked.offset <= after[0][0] and after[0][0] + after[0][1] <= leaked.end
    if budget is not None:
        assert len(before) > len(pool.plan.chunks)
    else:
        assert after == [(leaked.offset, leaked.nbytes)]
    # What stays locked stays mapped for the process's life (a fake registered nothing real).


# -- the real kernel -----------------------------------------------------------------------------------


class HeldMlock(MlockRuntime):
    """Real mlock whose register calls can be held at their start."""

    def __init__(self, holder: Callable[[str, int, int], None]) -> None:
        super().__init__()
        self.holder = holder

    def register(self, ptr: int, nbytes: int) -> None:
        self.holder("register", ptr, nbytes)
        super().register(ptr, nbytes)

    def lock_on_fault(self, ptr: int, nbytes: int) -> None:
        self.holder("register", ptr, nbytes)
        super().lock_on_fault(ptr, nbytes)


@needs_mlock
async def test_mlock_lists_its_locks_in_pieces_while_a_background_pool_pins(vmlck_baseline: int) -> None:
    holder = Holder(at={2, 3})
    runtime = HeldMlock(holder)
    pool = pinpool.PinnedPool(
        size=128 * MiB, max_chunk_bytes=64 * MiB, runtime=runtime, registry=None, background=True,
        register_workers=1, max_call_seconds=0.002,
    )  # fmt: skip
    assert pool.plan.order is pinpool._pin.pipeline.Order.REGISTER_FIRST
    samples: list[list[tuple[int, int]]] = []
    async with pool:
        while len(samples) < 2:
            if holder.held.is_set():
                samples.append(listed(pool))
                assert samples[-1] == books(runtime.registered, pool.data_ptr)
                holder.release()
            await anyio.sleep(0.001)
        await pool.wait_ready()
        ready = listed(pool)
        assert ready == books(runtime.registered, pool.data_ptr)
        assert locked_bytes() - vmlck_baseline >= 128 * MiB
    assert [len(s) for s in samples] == [1, 2]  # registered lock-on-fault, listed before they fault
    assert_tiles(ready, 128 * MiB)
    assert len(ready) > len(pool.plan.chunks)  # the first piece is a 16 MiB probe: at least 2 per 64 MiB chunk
    assert pool.registrations == () and runtime.registered == {}
    assert locked_bytes() == vmlck_baseline


@needs_mlock
def test_mlock_string_runtime_lists_whole_chunks(vmlck_baseline: int) -> None:
    with pinpool.PinnedPool(size=64 * MiB, chunk_bytes=16 * MiB, runtime="mlock", registry=None) as pool:
        assert isinstance(pool.runtime, MlockRuntime)
        assert listed(pool) == [(c.offset, c.nbytes) for c in pool.plan.chunks]
        assert listed(pool) == books(pool.runtime.registered, pool.data_ptr)
    assert pool.registrations == ()
    assert locked_bytes() == vmlck_baseline


def test_registrations_are_sorted_by_offset_for_an_interleaved_layout(fake: FakeRuntime) -> None:
    from pinpool import layouts

    layout = layouts.MHA("layer_first", layer_num=4, page_size=16, head_num=4, head_dim=64, dtype=torch.float16)
    with pinpool.PinnedPool(layout=layout, size="16MiB", chunk_bytes="1MiB", runtime=fake, registry=None) as pool:
        offsets = [r.offset for r in pool.registrations]
        assert offsets == sorted(offsets) and len(offsets) == len(fake.registered)
