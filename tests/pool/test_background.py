"""Background pinning: a pool the body uses while it pins, its state, readiness waits and failures."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import warnings

import anyio
import pytest
import torch

import pinpool
from pinpool import PinError, PinnedPool, PoolState, PoolStateError, layouts
from pinpool._ranges import PINNED_RANGES
from pinpool.testing import FakeRuntime, assert_released, locked_bytes

from ..conftest import lifecycle_of, needs_mlock

MiB = 1 << 20


def slow_pool(fake: FakeRuntime, **kw: object) -> PinnedPool:
    """16 chunks of 1 MiB, registered one at a time, 20 ms each: 0.3 s of pinning to observe."""
    options: dict[str, object] = {
        "size": 16 * MiB, "chunk_bytes": MiB, "runtime": fake, "registry": None, "register_workers": 1,
        "populate": False, "background": True,
    }  # fmt: skip
    options.update(kw)
    return PinnedPool(**options)  # type: ignore[arg-type]


async def until_pinning_ends(pool: PinnedPool) -> None:
    """Wait for background pinning to end without waiting on the pool (which would deliver its error)."""
    for _ in range(2000):
        if pool.state is not PoolState.PINNING:
            return
        await anyio.sleep(0.005)
    raise AssertionError("pinning did not end within 10 s")


@pytest.mark.anyio
async def test_enter_returns_while_pinning_and_pages_grow_from_the_start() -> None:
    fake = FakeRuntime(register_delay=0.02)
    pool = slow_pool(fake, name="bg-grow")
    seen: list[int] = []
    async with pool:
        assert pool.state is PoolState.PINNING
        assert pool.tensor.numel() == 16 * MiB  # usable at once: pages [0, pinned_pages) are pinned
        assert await pool.wait_ready(min_bytes="4MiB") >= 4 * MiB
        assert pool.state is PoolState.PINNING  # not all of it yet
        seen.append(pool.pinned_pages)
        # Registered chunks are exactly the prefix: lowest offsets first.
        bases = sorted(fake.registered)
        assert bases == [pool.data_ptr + i * MiB for i in range(len(bases))]
        assert await pool.wait_ready() == pool.num_pages
        assert pool.state is PoolState.READY
        assert pool.pinned_bytes == pool.nbytes
    assert_released(pool, fake)
    assert 4 * MiB <= seen[0] < 16 * MiB


@pytest.mark.anyio
async def test_fraction_and_bad_thresholds() -> None:
    fake = FakeRuntime(register_delay=0.01)
    async with slow_pool(fake, name="bg-fraction") as pool:
        assert await pool.wait_ready(fraction=0.25) >= 4 * MiB
        for kwargs, match in [
            ({"fraction": 0}, "fraction"), ({"fraction": 1.5}, "fraction"), ({"fraction": True}, "fraction"),
            ({"min_bytes": "1TiB"}, "holds"), ({"min_bytes": -1}, "min_bytes"),
            ({"min_bytes": 1, "fraction": 0.5}, "one of them"),
        ]:  # fmt: skip
            with pytest.raises(pinpool.ConfigError, match=match):
                await pool.wait_ready(**kwargs)  # type: ignore[arg-type]
    assert fake.registered == {}


@pytest.mark.anyio
async def test_leaving_while_pinning_stops_and_rolls_back() -> None:
    claimed = PINNED_RANGES.snapshot()  # other tests' deliberate leaks stay claimed for the process's life
    fake = FakeRuntime(register_delay=0.02)
    pool = slow_pool(fake, name="bg-leave")
    async with pool:
        await pool.wait_ready(min_bytes=2 * MiB)
    assert_released(pool, fake)
    assert len(fake.register_calls) < 16  # stopped after the calls in flight
    assert pool.pinned_bytes == 0 and pool.pinned_pages == 0
    assert PINNED_RANGES.snapshot() == claimed


@pytest.mark.anyio
async def test_a_background_failure_keeps_the_pinned_prefix_until_exit_and_every_waiter_raises() -> None:
    # The repro: 16 x 1 MiB chunks, one register worker, the 6th registration fails.
    fake = FakeRuntime(register_delay=0.01, fail_register_on=6)
    pool = PinnedPool(
        size="16MiB", chunk_bytes="1MiB", runtime=fake, register_workers=1, max_retries=0, background=True,
        name="bg-fail", registry=None,
    )  # fmt: skip
    with pytest.raises(PinError, match="register") as raised:
        async with pool:
            await pool.wait_ready(min_bytes="2MiB")
            in_use = pool.pinned_pages
            assert in_use >= 2
            with pytest.raises(PinError) as first:
                await pool.wait_ready()
            assert pool.state is PoolState.FAILED
            # Nothing is unpinned under the body: pages [0, pinned_pages) stay registered.
            base = pool.data_ptr
            assert pool.pinned_pages >= in_use
            assert all(
                base + off in fake.registered for off in range(0, pool.pinned_pages * pool.plan.page_bytes, 1 << 20)
            )
            assert len(fake.registered) == 5 and fake.unregister_calls == []
            assert "stay pinned" in str(first.value) and first.value.leaked == ()
            pool.tensor[: pool.pinned_bytes].fill_(7)  # the views stay usable
            with pytest.raises(PinError) as second:
                await pool.wait_ready(min_bytes=1)
            assert first.value is second.value is pool.error
            raise first.value  # the body lets it propagate: exit does not raise it twice
    assert not getattr(raised.value, "__notes__", None)
    assert_released(pool, fake)


@pytest.mark.anyio
async def test_an_unseen_background_failure_is_raised_on_exit() -> None:
    fake = FakeRuntime(register_delay=0.002, fail_register_on=3)
    pool = slow_pool(fake, name="bg-unseen", max_retries=0)
    with pytest.raises(PinError, match="register"):
        async with pool:
            await until_pinning_ends(pool)
    assert_released(pool, fake)


@pytest.mark.anyio
async def test_reading_pool_error_changes_nothing_exit_raises_it() -> None:
    """A read (a debugger's, a health endpoint's) is not a delivery: read twice, exit still raises it."""
    fake = FakeRuntime(fail_register_on=2)
    pool = slow_pool(fake, name="bg-read", max_retries=0)
    with pytest.raises(PinError) as raised:
        async with pool:
            await until_pinning_ends(pool)
            first = pool.error
            assert isinstance(first, PinError) and pool.error is first
    assert raised.value is first
    assert_released(pool, fake)


@pytest.mark.anyio
async def test_a_failure_a_waiter_raised_is_not_raised_again_and_a_body_error_gets_a_note() -> None:
    fake = FakeRuntime(fail_register_on=2)
    pool = slow_pool(fake, name="bg-seen", max_retries=0)
    async with pool:
        await until_pinning_ends(pool)
        with pytest.raises(PinError):
            await pool.wait_ready()  # raised to the body: delivered
    assert_released(pool, fake)

    fake = FakeRuntime(fail_register_on=2)
    pool = slow_pool(fake, name="bg-note", max_retries=0)
    with pytest.raises(KeyError) as raised:
        async with pool:
            await until_pinning_ends(pool)
            raise KeyError("the body's own error")
    assert any("pinning in the background had failed" in note for note in raised.value.__notes__)
    assert_released(pool, fake)


def test_the_sync_twin() -> None:
    fake = FakeRuntime(register_delay=0.01)
    pool = slow_pool(fake, name="bg-sync")
    with pool:
        with pytest.raises(TimeoutError, match="not ready after"):
            pool.wait_ready_sync(timeout=0.02)
        assert pool.wait_ready_sync(min_bytes=MiB) >= MiB
        assert pool.wait_ready_sync(timeout=30) == pool.num_pages
        assert pool.state is PoolState.READY
    assert_released(pool, fake)
    with pytest.raises(PoolStateError, match="exited before it was ready"):
        pool.wait_ready_sync()
    with pytest.raises(PoolStateError, match="enter it"):
        PinnedPool(size=MiB, runtime=FakeRuntime(), registry=None).wait_ready_sync()


@pytest.mark.anyio
async def test_a_foreground_pool_can_be_waited_for_from_another_task() -> None:
    """Readiness is not only for background pools: another task may wait while `async with` pins."""
    fake = FakeRuntime(register_delay=0.01)
    pool = slow_pool(fake, name="fg-wait", background=False)
    async with anyio.create_task_group() as tg:

        async def waiter() -> None:
            for _ in range(5000):
                if pool.state is not PoolState.NEW:
                    break
                await anyio.sleep(0.001)
            await pool.wait_ready(min_bytes=MiB)
            assert pool.state in (PoolState.PINNING, PoolState.READY)

        tg.start_soon(waiter)
        async with pool:
            assert pool.state is PoolState.READY
    assert_released(pool, fake)


def test_native_task_cancel_while_leaving_a_pinning_pool_still_rolls_back() -> None:
    """asyncio's own Task.cancel() (which anyio's shield does not stop) lands while exit waits."""
    fake = FakeRuntime(register_delay=0.05)
    pool = slow_pool(fake, name="bg-cancel")
    started = threading.Event()

    def before(op: str, _ptr: int, _nbytes: int) -> None:
        if op == "register" and len(fake.register_calls) >= 2:
            started.set()

    fake.before_call = before

    async def main() -> None:
        async def body() -> None:
            async with pool:
                await anyio.sleep(10)

        task = asyncio.ensure_future(body())
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        task.cancel()  # leaves the block: exit begins, waits for the conductor
        await asyncio.sleep(0.01)
        task.cancel()  # a second cancel lands inside that wait
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert_released(pool, fake)


def test_a_collected_pinning_pool_is_unpinned_by_its_conductor() -> None:
    fake = FakeRuntime(register_delay=0.02)
    pool = slow_pool(fake, name="bg-orphan")
    pool.__enter__()
    lifecycle = lifecycle_of(pool)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del pool  # the last reference: the finalizer runs now
        gc.collect()
    assert any("background" in str(w.message) for w in caught), [str(w.message) for w in caught]
    deadline = time.monotonic() + 10
    while lifecycle.state is not PoolState.CLOSED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lifecycle.state is PoolState.CLOSED
    assert fake.registered == {}


def test_state_is_public_and_in_the_repr() -> None:
    pool = PinnedPool(size=MiB, runtime=FakeRuntime(), registry=None)
    assert pool.state is PoolState.NEW and "new" in repr(pool)
    with pool:
        assert pool.state is PoolState.READY and pool.pinned_pages == pool.num_pages
    assert pool.state is PoolState.CLOSED
    assert pinpool.PoolState is PoolState
    with pytest.raises(pinpool.ConfigError, match="background"):
        PinnedPool(size=MiB, runtime=FakeRuntime(), registry=None, background="yes")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_kv_pages_grow_in_k_and_v_together() -> None:
    """A page is usable once its K and its V slices are pinned: the chunks interleave the halves."""
    mha = layouts.MHA("page_first", 2, 16, 4, 64, torch.bfloat16)  # one "kv" buffer: K's pages, then V's
    fake = FakeRuntime(register_delay=0.01)
    pool = PinnedPool(
        layout=mha, size=64 * MiB, chunk_bytes=4 * MiB, runtime=fake, registry=None, register_workers=1,
        populate=False, background=True,
    )  # fmt: skip
    async with pool:
        pages = await pool.wait_ready(fraction=0.25)
        assert pool.state is PoolState.PINNING
        half = pool.nbytes // 2
        registered = {base - pool.data_ptr for base in fake.registered}
        # Both halves have their first quarter registered, long before either half is done.
        assert {0, half} <= registered
        assert pages * pool.plan.page_bytes < pool.nbytes
    assert fake.registered == {}


@needs_mlock
@pytest.mark.anyio
async def test_mlock_background_pool_locks_while_the_body_runs(vmlck_baseline: int) -> None:

    pool = PinnedPool(size=512 * MiB, runtime="mlock", registry=None, background=True, name="bg-mlock")
    async with pool:
        page_counts = []
        while pool.state is PoolState.PINNING:
            page_counts.append(pool.pinned_pages)
            await anyio.sleep(0.002)
        await pool.wait_ready()
        assert locked_bytes() - vmlck_baseline >= 512 * MiB
        assert page_counts == sorted(page_counts)  # the prefix only grows
        pool.tensor[: 4 * MiB] = 7
    assert locked_bytes() == vmlck_baseline


@needs_mlock
def test_mlock_progress_moves_within_one_chunk(vmlck_baseline: int) -> None:
    """Lock-on-fault locks each span as it faults: progress moves inside a single-chunk pool."""

    values: list[int] = []
    pool = PinnedPool(
        size=512 * MiB, max_chunk_bytes=512 * MiB, runtime="mlock", registry=None, populate_workers=1,
        max_call_seconds=0.005, on_progress=lambda pinned, total, done, chunks: values.append(pinned),
    )  # fmt: skip
    with pool:
        assert len(pool.plan.chunks) == 1
    assert any(0 < v < 512 * MiB for v in values), values
    assert values == sorted(values) and values[-1] == 512 * MiB
    assert locked_bytes() == vmlck_baseline


def test_populated_bytes_move_ahead_of_registration_in_cuda_order() -> None:
    """Fault first, then register (CUDA's order): within a chunk the faulting is what moves."""
    fake = FakeRuntime(register_delay=0.05, populate_delay=0.001)
    pool = PinnedPool(
        size=64 * MiB, chunk_bytes=32 * MiB, runtime=fake, registry=None, register_workers=1, populate_workers=1,
        background=True, max_call_seconds=None,
    )  # fmt: skip
    seen: list[tuple[int, int]] = []
    with pool:
        for _ in range(5000):
            seen.append((pool.pinned_bytes, pool.stats.populated_bytes))
            if pool.state is not PoolState.PINNING:
                break
            time.sleep(0.001)
        pool.wait_ready_sync(timeout=30)
        assert pool.stats.populated_bytes == pool.nbytes
    assert any(populated > pinned for pinned, populated in seen)
    assert fake.registered == {}


@pytest.mark.parametrize("paced", [False, True])
def test_ctrl_c_inside_the_conductors_thread_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, paced: bool
) -> None:
    """KeyboardInterrupt lands inside Thread.start of the background conductor (it may already
    run, and, paced, be waiting for a node slot another pool holds): entering raises it, after
    the conductor was stopped and waited for, with nothing registered and no claim left."""
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        real_start(self)
        if self.name == "pinpool-bg-start-pin":
            raise KeyboardInterrupt

    claimed = PINNED_RANGES.snapshot()  # other tests' deliberate leaks stay claimed for the process's life
    node = {"node_slots": 1, "node_dir": str(tmp_path)} if paced else {}
    holder = slow_pool(FakeRuntime(register_delay=0.2), name="bg-holder", **node)
    fake = FakeRuntime(register_delay=0.01)
    pool = slow_pool(fake, name="bg-start", **node)
    with holder:
        holder.wait_ready_sync(min_bytes=1, timeout=10)  # it holds the only slot while it pins
        monkeypatch.setattr(threading.Thread, "start", start)
        with pytest.raises(KeyboardInterrupt):
            pool.__enter__()
        monkeypatch.undo()
        if paced:  # its wait for the slot was cancelled, not sat out until the holder was done
            assert holder.state is PoolState.PINNING and fake.register_calls == []
    assert_released(pool, fake)
    assert PINNED_RANGES.snapshot() == claimed


class _MlockFailingOn(pinpool.runtimes.MlockRuntime):
    """The real mlock runtime, whose n-th lock call fails as the host running out of memory would."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self._calls, self._n = 0, n

    def _maybe_fail(self, ptr: int, nbytes: int) -> None:
        self._calls += 1
        if self._calls == self._n:
            raise pinpool.RuntimeCallError(
                op="mlock2", code=12, reason="ENOMEM", message="injected", ptr=ptr, nbytes=nbytes
            )

    def lock_on_fault(self, ptr: int, nbytes: int) -> None:
        self._maybe_fail(ptr, nbytes)
        super().lock_on_fault(ptr, nbytes)

    def register(self, ptr: int, nbytes: int) -> None:
        self._maybe_fail(ptr, nbytes)
        super().register(ptr, nbytes)


@needs_mlock
def test_mlock_background_failure_keeps_the_prefix_locked_until_exit(vmlck_baseline: int) -> None:

    runtime = _MlockFailingOn(6)
    pool = PinnedPool(
        size=16 * MiB, chunk_bytes=MiB, runtime=runtime, register_workers=1, populate=False, max_retries=0,
        background=True, registry=None, name="bg-mlock-fail", max_call_seconds=None,
    )  # fmt: skip
    with pool:
        with pytest.raises(PinError, match="ENOMEM"):
            pool.wait_ready_sync(timeout=30)  # seen here, so exit does not raise it again
        assert pool.state is PoolState.FAILED
        kept = pool.pinned_pages * pool.plan.page_bytes
        assert kept >= MiB
        locked = locked_bytes() - vmlck_baseline
        assert locked >= kept  # the pages reported pinned are still locked while the body runs
        time.sleep(0.05)
        assert locked_bytes() - vmlck_baseline == locked  # and nothing unlocks them meanwhile
        pool.tensor[:kept].fill_(1)
    assert locked_bytes() == vmlck_baseline  # exit unpinned everything
