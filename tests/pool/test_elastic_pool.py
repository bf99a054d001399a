"""Elastic pools end to end (docs/elastic-design.md): reserve= maps the whole reservation once, entry pins the
floor, grow() pins whole segments (each usable only once pinned), shrink() unpins and gives pages back; a failure
or an interruption of a grow undoes only the segment in flight; exit tears every segment down, then the floor.
Real mlock for VmLck and given-back pages; FakeRuntime and FakeRegistrar for fault injection and books."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import signal
import threading
import time
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from prometheus_client import CollectorRegistry

import pinpool
from pinpool._host import HostMapping
from pinpool._ranges import PINNED_RANGES
from pinpool.testing import FakeRegistrar, FakeRuntime, assert_released, locked_bytes

from ..depth import depth, runs
from .test_open_close import in_forked_child

MiB = 1 << 20


def elastic(runtime: object, **options: object) -> pinpool.PinnedPool:
    """4 MiB floor, 12 MiB reserved, segments of 2 MiB in 1 MiB chunks (Raw: a page is a byte)."""
    given: dict[str, object] = {
        "size": 4 * MiB, "reserve": 12 * MiB, "grow_step": 2 * MiB, "chunk_bytes": MiB, "registry": None,
    }  # fmt: skip
    return pinpool.PinnedPool(runtime=runtime, **{**given, **options})  # type: ignore[arg-type]


def test_grow_use_shrink_with_mlock() -> None:
    before, claims = locked_bytes(), PINNED_RANGES.snapshot()
    pool = elastic("mlock")
    with pool:
        tensor = pool.tensor
        assert (pool.num_pages, pool.reserved_pages, pool.pinned_runs) == (12 * MiB, 12 * MiB, (range(0, 4 * MiB),))
        assert locked_bytes() - before == 4 * MiB  # the floor only: the rest is reserved, not pinned
        grown = pool.grow_sync(pages=3 * MiB)  # whole segments: two of 2 MiB
        assert grown.pages == (range(4 * MiB, 8 * MiB),)
        assert pool.pinned_runs == (range(0, 8 * MiB),) and pool.pinned_pages == 8 * MiB
        assert locked_bytes() - before == 8 * MiB == pool.pinned_bytes
        assert pool.tensor is tensor  # the views never change
        tensor[4 * MiB : 8 * MiB].fill_(7)
        shrunk = pool.shrink_sync(pages=[range(6 * MiB, 8 * MiB), range(4 * MiB, 5 * MiB)])
        assert (shrunk.released, shrunk.kept) == ((range(6 * MiB, 8 * MiB),), (range(4 * MiB, 5 * MiB),))
        assert locked_bytes() - before == 6 * MiB
        assert int(tensor[6 * MiB : 8 * MiB].count_nonzero()) == 0  # given back: it reads zero
        assert int(tensor[4 * MiB : 6 * MiB].count_nonzero()) == 2 * MiB  # the kept segment is untouched
        assert pool.pinned_runs == (range(0, 6 * MiB),)
    assert_released(pool, claims_before=claims, locked_before=before)


def test_a_reservation_larger_than_the_host_costs_nothing_until_grown() -> None:
    # The heuristic overcommit mode refuses one plain mapping larger than RAM + swap; the reservation is mapped
    # MAP_NORESERVE, so a server may reserve more than this host has and grow as far as the host lets it.
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    host_bytes = sum(int(meminfo[key].split()[0]) << 10 for key in ("MemTotal", "SwapTotal"))
    reserve = -(-2 * host_bytes // (1 << 30)) << 30
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "2":
        pytest.skip("vm.overcommit_memory=2 (strict) charges every private mapping whole: MAP_NORESERVE is ignored")
    with pytest.raises(pinpool.AllocationError, match="ENOMEM"):
        HostMapping(reserve)  # a fixed pool's mapping of that size: refused (its pre-flight refuses it first)
    before = locked_bytes()
    with elastic("mlock", reserve=reserve, grow_step="1GiB", chunk_bytes="64MiB") as pool:
        assert pool.reserved_pages == reserve and locked_bytes() - before == 4 * MiB
        grown = pool.grow_sync(pages=1)
        assert grown.pages == (range(4 * MiB, 4 * MiB + (1 << 30)),) and locked_bytes() - before == 4 * MiB + (1 << 30)
        pool.shrink_sync(to_pages=4 * MiB)
        assert locked_bytes() - before == 4 * MiB
    assert locked_bytes() == before


def test_a_middle_shrink_ends_pinned_pages_but_not_pinned_runs() -> None:
    with elastic("mlock") as pool:
        pool.grow_sync(nbytes="8MiB")
        pool.shrink_sync(pages=[range(6 * MiB, 8 * MiB)])
        assert pool.pinned_runs == (range(0, 6 * MiB), range(8 * MiB, 12 * MiB))
        assert pool.pinned_pages == 6 * MiB
        assert pool.grow_sync(pages=1).pages == (range(6 * MiB, 8 * MiB),)  # the lowest free segment again
        assert pool.pinned_pages == 12 * MiB


@pytest.mark.anyio
async def test_grow_and_shrink_async() -> None:
    fake = FakeRuntime()
    pool = elastic(fake)
    async with pool:
        await pool.grow(pages=2 * MiB)
        assert pool.pinned_runs == (range(0, 6 * MiB),)
        assert sorted(fake.registered.values()) == [MiB] * 6
        shrunk = await pool.shrink(to_pages=4 * MiB)
        assert shrunk.released == (range(4 * MiB, 6 * MiB),)
        assert sorted(fake.registered.values()) == [MiB] * 4
        await pool.grow(pages=8 * MiB)
        assert pool.pinned_pages == 12 * MiB and len(pool.registrations) == 12
    assert_released(pool, fake)


def test_a_failing_segment_rolls_back_alone() -> None:
    fake = FakeRuntime()
    with elastic(fake) as pool:
        pool.grow_sync(pages=2 * MiB)
        held = dict(fake.registered)
        fake.fail_next(10_000)  # every register (and each retried half) of the next segment fails
        with pytest.raises(pinpool.PinError, match="segment 2"):
            pool.grow_sync(pages=4 * MiB)
        fake.fail_next(0)
        assert fake.registered == held  # the segment in flight is undone; the one grown before stays
        assert pool.pinned_runs == (range(0, 6 * MiB),)
        assert pool.grow_sync(pages=2 * MiB).pages == (range(6 * MiB, 8 * MiB),)  # and it can grow again
    assert_released(pool, fake)


def test_a_grows_rollback_gives_pages_back_but_counts_nothing_released() -> None:
    # pinpool_released_bytes_total counts shrinks' give-backs: a failed grow's rolled-back pages went back to the
    # host as well, but they were never pinned usable, so grown minus released stays what is pinned.
    registry, fake = CollectorRegistry(), FakeRuntime()

    def sample(name: str) -> float:
        return registry.get_sample_value(name, {"pool": "default", "runtime": "fake"}) or 0.0

    with elastic(fake, registry=registry) as pool:
        fake.fail_next(1, "populate")
        with pytest.raises(pinpool.PinError):
            pool.grow_sync(pages=2 * MiB)
        assert (sample("pinpool_grown_bytes_total"), sample("pinpool_released_bytes_total")) == (0, 0)
        pool.grow_sync(pages=2 * MiB)
        pool.shrink_sync(to_pages=4 * MiB)
        assert (sample("pinpool_grown_bytes_total"), sample("pinpool_released_bytes_total")) == (2 * MiB, 2 * MiB)


def test_a_failed_grow_whose_rollback_leaks_says_so() -> None:
    # The floor's 4 register calls pass, the segment's first too; then every register fails, and the rollback's
    # one unregister (of that first chunk) fails: the error names the chunk that may stay pinned.
    fake = FakeRuntime(fail_register_on=range(6, 100), fail_unregister_on=1)
    with elastic(fake) as pool:
        base = pool.data_ptr
        with pytest.raises(pinpool.PinError, match="segment 1") as failed:
            pool.grow_sync(pages=1)
        assert "could not be unregistered and may still be pinned" in str(failed.value)
        assert "every registered chunk was rolled back" not in str(failed.value)
        assert [c.offset for c in failed.value.leaked] == [4 * MiB]
        assert pool.pinned_runs == (range(0, 4 * MiB),) and pool.pinned_bytes == 5 * MiB  # counted, not usable
    assert fake.registered == {base + 4 * MiB: MiB}  # kept registered for good (never unpinned behind the runtime)


@pytest.mark.anyio
async def test_cancelling_a_grow_undoes_its_segment() -> None:
    started = threading.Event()

    def before(op: str, ptr: int, nbytes: int) -> None:
        if op == "register" and len(fake.register_calls) > 4:  # a segment's register: the floor made 4
            started.set()

    fake = FakeRuntime(register_delay=0.02, before_call=before)
    pool = elastic(fake)
    async with pool:
        held = dict(fake.registered)
        async with anyio.create_task_group() as group:

            async def grow() -> None:
                await pool.grow(pages=8 * MiB)

            group.start_soon(grow)
            assert await anyio.to_thread.run_sync(started.wait, 10)
            group.cancel_scope.cancel()
        assert fake.registered == held and pool.pinned_runs == (range(0, 4 * MiB),)
        assert (await pool.grow(pages=1)).pages == (range(4 * MiB, 6 * MiB),)  # not wedged
    assert_released(pool, fake)


def test_shrink_refuses_what_is_not_given_up() -> None:
    with elastic(FakeRuntime()) as pool:
        pool.grow_sync(pages=2 * MiB)
        runs = pool.pinned_runs
        with pytest.raises(pinpool.PoolStateError, match="floor"):
            pool.shrink_sync(pages=[range(3 * MiB, 5 * MiB)])
        with pytest.raises(pinpool.PoolStateError, match="not usable now"):
            pool.shrink_sync(pages=[range(6 * MiB, 7 * MiB)])  # never grown
        with pytest.raises(pinpool.ConfigError, match="not a range"):
            pool.shrink_sync(pages=[range(0, 13 * MiB)])
        with pytest.raises(pinpool.ConfigError, match="one of them"):
            pool.shrink_sync()
        with pytest.raises(pinpool.PoolStateError, match="at most"):
            pool.grow_sync(pages=9 * MiB)
        assert pool.pinned_runs == runs  # refusals change nothing
    with pytest.raises(pinpool.PoolStateError, match="closed"):
        pool.grow_sync(pages=1)
    with pinpool.PinnedPool(size=MiB, runtime=FakeRuntime(), registry=None) as fixed:
        with pytest.raises(pinpool.ConfigError, match="reserve="):
            fixed.grow_sync(pages=1)


def test_reserve_option_is_checked() -> None:
    with pytest.raises(pinpool.ConfigError, match="reserve="):
        pinpool.PinnedPool(size="4MiB", reserve="2MiB", runtime=FakeRuntime(), registry=None)
    with pytest.raises(pinpool.ConfigError, match="multiple of"):
        pinpool.PinnedPool(size=4 * MiB + 1, reserve="8MiB", runtime=FakeRuntime(), registry=None)


def test_registrars_register_per_segment_and_pieces_never_straddle() -> None:
    fake, engine = FakeRuntime(), FakeRegistrar("engine")
    with elastic(fake, registrars=[engine]) as pool:
        pool.grow_sync(pages=2 * MiB)
        registered = pool.transfer_registrations("engine")
        floor_end, segment_end = 4 * MiB, 6 * MiB
        assert all(r.offset + r.nbytes <= floor_end or r.offset >= floor_end for r in registered)
        assert sum(r.nbytes for r in registered) == segment_end
        pieces = pool.transfer_pieces("engine", pages=range(3 * MiB, 5 * MiB))
        assert sum(p.nbytes for p in pieces) == 2 * MiB
        for piece in pieces:
            holder = piece.registration
            assert holder.offset <= piece.offset and piece.offset + piece.nbytes <= holder.offset + holder.nbytes
        with pytest.raises(pinpool.PoolStateError, match="not registered"):
            pool.transfer_pieces("engine", pages=range(5 * MiB, 7 * MiB))  # segment 2 was never grown
        pool.shrink_sync(to_pages=4 * MiB)
        assert sum(r.nbytes for r in pool.transfer_registrations("engine")) == floor_end
    assert_released(pool, fake)
    assert engine.registered == {}


def test_close_from_another_thread_stops_a_grow() -> None:
    started = threading.Event()
    fake = FakeRuntime(register_delay=0.01, before_call=lambda op, *_: started.set() if pool.pinned_bytes else None)
    pool = elastic(fake)
    pool.open()
    closer = threading.Thread(target=lambda: (started.wait(5), pool.close()))
    started.clear()
    closer.start()
    with pytest.raises(pinpool.PoolStateError, match="closed"):
        pool.grow_sync(pages=8 * MiB)
    closer.join()
    assert_released(pool, fake)


def test_the_plan_shows_the_reservation() -> None:
    pool = elastic(FakeRuntime())
    reservation = pool.plan.reservation
    assert reservation is not None and (reservation.num_pages, reservation.floor_pages) == (12 * MiB, 4 * MiB)
    assert [s.pages for s in reservation.segments] == [range(0, 4 * MiB), *(range(p, p + 2 * MiB) for p in
                                                       range(4 * MiB, 12 * MiB, 2 * MiB))]  # fmt: skip
    assert all(c.offset + c.nbytes <= s.slices[0][1] for s in reservation.segments for c in s.chunks)
    assert pool.num_pages == pool.nbytes == 12 * MiB  # the views describe the whole reservation
    assert pinpool.PinnedPool(size=MiB, runtime=FakeRuntime(), registry=None).plan.reservation is None


def test_the_finalizer_and_a_forked_child_let_segments_go() -> None:
    fake = FakeRuntime()
    pool = elastic(fake, name="elastic-collected")
    pool.open()
    pool.grow_sync(pages=4 * MiB)
    assert in_forked_child(pool.close) == "ok"  # the child disowns the parent's sessions
    assert len(fake.registered) == 8  # the parent's are untouched
    with pytest.warns(pinpool.UnclosedPoolWarning, match="unpinned its 8 MiB in a finalizer"):
        del pool  # the finalizer: every segment, then the floor
        gc.collect()
    assert fake.registered == {}


def test_a_shared_pool_grows_shrinks_and_grows_again() -> None:
    before = locked_bytes()
    region = pinpool.SharedMemory()  # a memfd
    with elastic("mlock", memory=region) as pool:
        pool.grow_sync(pages=2 * MiB)
        pool.tensor[4 * MiB : 6 * MiB].fill_(3)
        pool.shrink_sync(to_pages=4 * MiB)  # no other process maps it: a hole is punched in the file
        assert locked_bytes() - before == 4 * MiB
        assert int(pool.tensor[4 * MiB : 6 * MiB].count_nonzero()) == 0
        pool.grow_sync(pages=2 * MiB)  # the hole is allocated again before it is faulted
        assert locked_bytes() - before == 6 * MiB
    assert locked_bytes() == before


@pytest.mark.anyio
async def test_close_on_the_event_loop_during_a_shrink_returns() -> None:
    """A close() on the loop's own thread (a signal handler, a sync callback) while an async shrink on that loop
    waits for its unpin threads: it waited for the shrink, which waited for the loop. Now the close finishes the
    shrink's segment itself and returns, the shrink returns after it, and nothing stays pinned or claimed."""
    in_unregister = threading.Event()

    def unregistering(op: str, ptr: int, nbytes: int) -> None:
        if op == "unregister":
            in_unregister.set()

    fake = FakeRuntime(unregister_delay=0.02, before_call=unregistering)
    pool = elastic(fake)
    pool.open()
    pool.grow_sync(pages=8 * MiB)
    shrunk: list[object] = []

    async def shrink() -> None:
        shrunk.append(await pool.shrink(to_pages=4 * MiB))

    faulthandler.dump_traceback_later(60, exit=True)  # a regression hangs the loop: no timeout of anyio's can fire
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(shrink)
            assert await anyio.to_thread.run_sync(in_unregister.wait, 10)
            pool.close()  # synchronously, on the loop's thread, with the shrink's unpin threads at work
            assert pool.state is pinpool.PoolState.CLOSED
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert len(shrunk) == 1
    assert_released(pool, fake)


def test_a_shrink_tears_down_every_segment_it_released_whatever_fails() -> None:
    """One segment's unregister fails: the shrink still tears the others down (they were stranded releasing,
    pinned until exit), raises the UnpinError, and the leaked segment's chunk stays counted and listed."""
    fake = FakeRuntime()
    pool = elastic(fake)
    pool.open()
    pool.grow_sync(pages=8 * MiB)
    fake.fail_next(1, "unregister")
    with pytest.raises(pinpool.UnpinError):
        pool.shrink_sync(to_pages=4 * MiB)
    held = sum(fake.registered.values())
    assert held == 5 * MiB  # the floor and the chunk that failed to unregister
    assert pool.pinned_bytes == held and sum(c.nbytes for c in pool.registrations) == held
    assert pool.pinned_runs == (range(0, 4 * MiB),)
    assert pool.grow_sync(pages=2 * MiB).pages == (range(4 * MiB, 6 * MiB),)  # free segments grow again
    pool.close()  # the shrink reported the leak; the exit unpins the rest and keeps the mapping (never freed)
    assert sum(fake.registered.values()) == MiB and pool.state is pinpool.PoolState.CLOSED


def test_a_forked_child_neither_grows_nor_shrinks_its_parents_pool() -> None:
    fake = FakeRuntime()
    pool = elastic(fake)
    pool.open()
    pool.grow_sync(pages=4 * MiB)

    def child() -> None:
        with pytest.raises(pinpool.PoolStateError, match="forked child"):
            pool.shrink_sync(to_pages=6 * MiB)
        with pytest.raises(pinpool.PoolStateError, match="forked child"):
            pool.grow_sync(pages=1)
        pool.close()
        assert pool.pinned_runs == () and pool.pinned_pages == 0

    assert in_forked_child(child) == "ok"
    assert pool.pinned_runs == (range(0, 8 * MiB),) and len(fake.registered) == 8  # the parent's, untouched
    pool.close()
    assert_released(pool, fake)


READS = {
    "pinned_runs": lambda pool, _registrar: pool.pinned_runs,
    "registrations": lambda pool, _registrar: pool.registrations,
    "stats": lambda pool, _registrar: pool.stats,
    "data_ptr": lambda pool, _registrar: pool.data_ptr,
    "transfer_pieces": lambda pool, registrar: pool.transfer_pieces(registrar, pages=range(0, 4 * MiB)),
    "transfer_registrations": lambda pool, registrar: pool.transfer_registrations(registrar),
}


@depth
@pytest.mark.parametrize("read", sorted(READS))
@pytest.mark.parametrize("reserve", [None, 12 * MiB], ids=["fixed", "elastic"])
def test_close_from_a_signal_handler_while_the_main_thread_reads_returns(read: str, reserve: int | None) -> None:
    """A handler's close() landing while the main thread reads the pool (a readiness probe, a transfer's
    pieces): it deadlocked on the segments' lock (pinned_runs) and on the session's (the transfer reads), and
    transfer_pieces raised an AssertionError; now it closes the pool every time, and a read the close overtook
    raises PoolStateError."""
    faulthandler.dump_traceback_later(60, exit=True)  # a regression hangs the main thread
    try:
        for attempt in range(runs(12, 40)):
            fake, registrar = FakeRuntime(), FakeRegistrar()
            pool = elastic(fake, reserve=reserve, registrars=[registrar])
            pool.open()
            if reserve is not None:
                pool.grow_sync(pages=2 * MiB)
            closed: list[object] = []
            previous = signal.signal(signal.SIGALRM, lambda *_, p=pool, c=closed: c.append(p.close()))
            try:
                signal.setitimer(signal.ITIMER_REAL, 0.001 + (attempt % 7) * 0.0003)
                deadline = time.monotonic() + 10
                while not closed and time.monotonic() < deadline:
                    with contextlib.suppress(pinpool.PoolStateError):
                        READS[read](pool, registrar)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            assert closed == [None], attempt
            assert registrar.registered == {}
            assert_released(pool, fake)
    finally:
        faulthandler.cancel_dump_traceback_later()
