"""The pinned page prefix (pure), the pin order across page runs, and the stall budget."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

import pinpool
from pinpool import PinnedPool, layouts
from pinpool._plan import (
    MAX_GROWTH,
    PROBE_BYTES,
    CallSizer,
    Chunk,
    ChunkTable,
    PageRun,
    PrefixTracker,
    page_runs,
    pin_order,
)
from pinpool.testing import FakeRuntime, locked_bytes

from ..conftest import needs_mlock

MiB = 1 << 20


def test_page_runs_of_the_layouts() -> None:
    assert page_runs([(0, 100, 1)], 10) == (PageRun(0, 100, 10),)
    assert page_runs([(0, 100, 2), (128, 50, 1)], 10) == (
        PageRun(0, 50, 5), PageRun(50, 100, 5), PageRun(128, 178, 5),
    )  # fmt: skip
    # Unknown placement, or one that does not divide: usable only when whole.
    assert page_runs([(0, 100, None)], 10) == (PageRun(0, 100, None),)
    assert page_runs([(0, 101, 1)], 10) == (PageRun(0, 101, None),)
    assert page_runs([(0, 0, 1)], 10) == ()


@st.composite
def runs_and_chunks(draw: st.DrawFn) -> tuple[tuple[PageRun, ...], int, ChunkTable]:
    num_pages = draw(st.integers(1, 6))
    buffers, offset = [], 0
    for _ in range(draw(st.integers(1, 3))):
        count = draw(st.sampled_from([1, 2, 3, None]))
        per_page = draw(st.integers(1, 4))
        nbytes = num_pages * per_page * (count or 1)
        buffers.append((offset, nbytes, count))
        offset += nbytes + draw(st.integers(0, 3))
    runs = page_runs(buffers, num_pages)
    chunks: list[Chunk] = []
    for start, nbytes, _count in buffers:
        cut = start
        while cut < start + nbytes:
            size = min(draw(st.integers(1, 7)), start + nbytes - cut)
            chunks.append(Chunk(cut, size))
            cut += size
    return runs, num_pages, ChunkTable.of(chunks)


def brute_pages(runs: tuple[PageRun, ...], num_pages: int, pinned: set[int]) -> int:
    """The largest k with every byte of pages [0, k) pinned, byte by byte."""
    for page in range(num_pages, 0, -1):
        if all(
            all(b in pinned for b in range(run.start, run.end))  # pages spread out: all of it
            if run.page_bytes is None
            else all(b in pinned for b in range(run.start, run.start + page * run.page_bytes))
            for run in runs
        ):
            return page
    return 0


@given(case=runs_and_chunks(), seed=st.integers(0, 2**32))
@settings(max_examples=300, deadline=None)
def test_prefix_tracker_matches_brute_force_in_any_order(
    case: tuple[tuple[PageRun, ...], int, ChunkTable], seed: int
) -> None:
    runs, num_pages, chunks = case
    order = list(chunks)
    random.Random(seed).shuffle(order)
    tracker, pinned = PrefixTracker(runs, num_pages), set()
    for chunk in order:
        tracker.cover(chunk.offset, chunk.end)
        pinned.update(range(chunk.offset, chunk.end))
        assert tracker.pages == brute_pages(runs, num_pages, pinned)
    assert tracker.pages == num_pages


@given(case=runs_and_chunks())
@settings(max_examples=300, deadline=None)
def test_pin_order_is_a_permutation_that_keeps_offset_order_within_each_run(
    case: tuple[tuple[PageRun, ...], int, ChunkTable],
) -> None:
    runs, _num_pages, chunks = case
    ordered = list(pin_order(chunks, runs))
    assert sorted(ordered) == sorted(chunks)
    # Lowest offset first within a run (a chunk straddling two runs is keyed by the run it
    # helps most, so it may come early; the tracker accepts ranges in any order).
    for run in runs:
        inside = [c.offset for c in ordered if run.start <= c.offset and c.end <= run.end]
        assert inside == sorted(inside)


def test_pin_order_interleaves_k_and_v() -> None:
    runs = page_runs([(0, 8, 2)], 4)  # K: bytes 0-3, V: bytes 4-7, one byte per page
    chunks = ChunkTable([(0, 2, 4)])
    assert [c.offset for c in pin_order(chunks, runs)] == [0, 4, 2, 6]
    single = ChunkTable([(0, 2, 4)])
    assert pin_order(single, page_runs([(0, 8, 1)], 8)) is single  # one run: offset order, still lazy


# -- the stall budget -------------------------------------------------------------------------


def test_call_sizer_probes_then_follows_the_slowest_recent_rate() -> None:
    sizer = CallSizer(0.02)
    unit = 2 * MiB
    assert sizer.next_bytes(unit, 1 << 40) == PROBE_BYTES
    sizer.record(PROBE_BYTES, 0.004)  # 4 GB/s-ish: 16 MiB in 4 ms
    grown = sizer.next_bytes(unit, 1 << 40)
    assert grown % unit == 0 and PROBE_BYTES < grown <= PROBE_BYTES * MAX_GROWTH
    assert grown * 0.004 / PROBE_BYTES <= 0.02  # predicted within the budget
    sizer.record(grown, 0.2)  # a slowdown: the next call shrinks at once
    assert sizer.next_bytes(unit, 1 << 40) < grown
    assert sizer.next_bytes(unit, unit // 2) == unit // 2  # less than a unit left: that rest
    assert sizer.next_bytes(unit, 3 * unit) <= 3 * unit
    assert sizer.longest == 0.2
    with pytest.raises(ValueError, match="positive"):
        CallSizer(0)


def rate_limited_fake(bytes_per_second: float, **kw: object) -> FakeRuntime:
    """A fake whose register and populate calls take time in proportion to their size."""
    fake = FakeRuntime(**kw)  # type: ignore[arg-type]

    def before(op: str, _ptr: int, nbytes: int) -> None:
        if op in ("register", "populate"):
            time.sleep(nbytes / bytes_per_second)

    fake.before_call = before
    return fake


def test_a_budget_keeps_every_call_short_aligned_and_undone_by_base() -> None:
    granularity = 3 * MiB  # unit: lcm(3 MiB, 4 KiB) = 3 MiB
    fake = rate_limited_fake(2e9)  # 2 GB/s: a 1.5 GiB chunk would take 0.8 s in one call
    # How much longer than its modelled time each register call's sleep took: the scheduling
    # delay of a loaded machine (parallel workers), which the wall-clock metric includes too.
    overshoot = [0.0]
    sleep = fake.before_call
    assert sleep is not None

    def timed(op: str, ptr: int, nbytes: int) -> None:
        started = time.perf_counter()
        sleep(op, ptr, nbytes)
        if op == "register":
            overshoot.append(time.perf_counter() - started - nbytes / 2e9)

    fake.before_call = timed
    registry = CollectorRegistry()
    pool = PinnedPool(
        layout=layouts.Raw(granularity_bytes=granularity), size=1536 * MiB, max_chunk_bytes=768 * MiB, runtime=fake,
        registry=registry, max_call_seconds=0.02, populate=False, register_workers=1,
    )  # fmt: skip
    with pool:
        calls = list(fake.register_calls)
        assert pool.pinned_bytes == pool.nbytes
        longest = registry.get_sample_value(  # read while open: a closed pool's gauges are removed
            "pinpool_call_seconds_max", {"pool": "default", "runtime": "fake", "op": "register"}
        )
    assert fake.registered == {}  # every piece was unregistered by its own base
    assert len(fake.unregister_calls) == len(calls)
    sizes = [n for _ptr, n in calls]
    assert sum(sizes) == pool.nbytes
    assert all((ptr - pool_base(calls)) % granularity == 0 for ptr, _n in calls)
    assert max(sizes) * 1.0 / 2e9 <= 0.02 * 1.5  # no call over the budget (by the fake's clock)
    assert longest is not None and 0 < longest <= 0.03 + max(overshoot)  # within the budget, but for the delay


def pool_base(calls: list[tuple[int, int]]) -> int:
    return min(ptr for ptr, _n in calls)


def test_without_a_budget_calls_are_whole_chunks(fake: FakeRuntime) -> None:
    with PinnedPool(size=64 * MiB, chunk_bytes=16 * MiB, runtime=fake, registry=None, populate=False):
        pass
    assert [n for _p, n in fake.register_calls] == [16 * MiB] * 4


def test_a_budget_with_a_failing_piece_rolls_back_the_pieces_before_it() -> None:
    fake = rate_limited_fake(4e9, fail_register_on=5)
    pool = PinnedPool(
        size=256 * MiB, max_chunk_bytes=256 * MiB, runtime=fake, registry=None, max_call_seconds=0.01, populate=False,
        max_retries=0,
    )  # fmt: skip
    from pinpool import PinError

    with pytest.raises(PinError, match="register"):
        with pool:
            pass
    assert fake.registered == {}
    assert len(fake.register_calls) == 5  # four pieces registered, the fifth failed: all undone


def test_max_call_seconds_is_validated() -> None:
    from pinpool import ConfigError

    for bad in (0, -1, float("inf"), float("nan"), True, "20ms"):
        with pytest.raises(ConfigError, match="max_call_seconds"):
            PinnedPool(size=MiB, runtime=FakeRuntime(), registry=None, max_call_seconds=bad)  # type: ignore[arg-type]


@needs_mlock
def test_mlock_populate_calls_fit_the_budget(vmlck_baseline: int) -> None:

    registry = CollectorRegistry()
    with PinnedPool(size=512 * MiB, runtime="mlock", registry=registry, max_call_seconds=0.02, name="budget"):
        assert locked_bytes() - vmlck_baseline >= 512 * MiB
        populate = registry.get_sample_value(  # read while open: a closed pool's gauges are removed
            "pinpool_call_seconds_max", {"pool": "budget", "runtime": "mlock", "op": "populate"}
        )
    # The first call is a 16 MiB probe; later calls follow the measured rate. A shared 2-core
    # machine can stall any call, so the bound is loose: far below one 256 MiB span's time.
    assert populate is not None and populate < 0.25
    assert locked_bytes() == vmlck_baseline


def test_leaving_stops_between_the_pieces_of_one_chunk() -> None:
    """Under a budget a 512 MiB chunk is many calls; leaving stops after the call in flight, not
    after the whole chunk, and the pieces registered so far are undone by their own bases."""
    fake = rate_limited_fake(1e9)  # ~1 ms per MiB: the chunk takes ~0.5 s in pieces
    pool = PinnedPool(
        size=512 * MiB, max_chunk_bytes=512 * MiB, runtime=fake, registry=None, max_call_seconds=0.01, populate=False,
        background=True,
    )  # fmt: skip
    with pool:
        pool.wait_ready_sync(min_bytes=16 * MiB, timeout=30)  # some pieces are in
    registered = sum(n for _p, n in fake.register_calls)
    assert 16 * MiB <= registered < pool.nbytes  # stopped part-way through the only chunk
    assert fake.registered == {}
    assert len(fake.unregister_calls) == len(fake.register_calls)


def test_progress_moves_within_a_chunk_registered_in_pieces() -> None:
    """Registration order as under CUDA (fault first, then register): each registered piece of a
    chunk counts as pinned, and extends the usable page prefix, before the chunk is whole."""
    fake = rate_limited_fake(2e9)
    seen: list[int] = []
    pool = PinnedPool(
        size=256 * MiB, max_chunk_bytes=256 * MiB, runtime=fake, registry=None, max_call_seconds=0.01,
        populate=False, background=True,
    )  # fmt: skip
    with pool:
        for _ in range(10_000):
            seen.append(pool.pinned_pages)
            if pool.state is not pinpool.PoolState.PINNING:
                break
            time.sleep(0.001)
        pool.wait_ready_sync(timeout=30)
    assert len(pool.plan.chunks) == 1
    assert any(0 < pages < pool.num_pages for pages in seen), seen[:20]
    assert seen == sorted(seen)


def test_calls_never_shrink_below_what_is_sampled() -> None:
    """A fixed cost per call above the budget must not shrink calls forever: they stay >= 1 MiB."""
    fake = FakeRuntime(register_delay=0.02)  # 20 ms per call whatever its size, budget 10 ms
    with PinnedPool(
        size=64 * MiB, max_chunk_bytes=64 * MiB, runtime=fake, registry=None, max_call_seconds=0.01, populate=False
    ):
        pass
    sizes = [n for _p, n in fake.register_calls]
    assert min(sizes[:-1]) >= MiB  # every call but the tail of the chunk
    assert len(sizes) <= 64


def test_workers_begin_only_once_all_are_started(fake: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """A populate call holds mmap_lock and starting a thread maps its stack: no runtime call may
    begin while pinning threads are still being started."""
    import threading

    started: list[str] = []
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        real_start(self)
        if self.name.startswith("pinpool-barrier-") and self.name[-1].isdigit():
            started.append(self.name)
            time.sleep(0.01)  # a slow start: a worker that did not wait would call meanwhile

    monkeypatch.setattr(threading.Thread, "start", start)
    at_first_call: list[int] = []
    fake.before_call = lambda op, ptr, n: at_first_call.append(len(started)) if not at_first_call else None
    pool = PinnedPool(
        size=64 * MiB, chunk_bytes=4 * MiB, runtime=fake, registry=None, name="barrier", populate_workers=3,
        register_workers=2,
    )  # fmt: skip
    with pool:
        pass
    assert pool.plan.threads >= 4
    assert at_first_call == [pool.plan.threads]


def test_lock_on_fault_pieces_follow_the_faulting_rate() -> None:
    """Under lock-on-fault the registration is quick but unlocking a piece later holds the lock as
    long as faulting it did: pieces are sized by the faulting rate, not the registration's."""
    fake = FakeRuntime(lock_on_fault=True)

    def before(op: str, _ptr: int, nbytes: int) -> None:
        if op == "populate":
            time.sleep(nbytes / 1e9)  # faulting at 1 GB/s; registering is instant

    fake.before_call = before
    with PinnedPool(
        size=256 * MiB, max_chunk_bytes=256 * MiB, runtime=fake, registry=None, max_call_seconds=0.01,
        populate_workers=1, register_workers=1,
    ):  # fmt: skip
        pass
    pieces = [n for _p, n in fake.register_calls]
    assert sum(pieces) == 256 * MiB and len(pieces) > 1
    assert max(pieces) <= 16 * MiB  # ~6 MiB fits 60 % of 10 ms at 1 GB/s; never the whole chunk
    assert fake.registered == {}
