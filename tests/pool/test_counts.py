"""Honest counts after a failure (issue 22): ``pinned_bytes``, ``pinned_pages``, ``registrations``,
the error text and the ``pinpool_pinned_bytes`` gauge say the same, and agree with the runtime's
books (FakeRuntime.registered; VmLck under the real mlock runtime), however pinning failed:
on a chunk's first, middle or last piece, or faulting a chunk registered lock-on-fault; and all
are zero, with nothing registered, once the pool is exited."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

import pinpool
from pinpool import Chunk, PinError, PinnedPool, PoolState
from pinpool._host import populate_range
from pinpool._units import format_bytes
from pinpool.testing import FakeRuntime, locked_bytes

from ..conftest import each_driver, lifecycle_of, needs_mlock, pin_and_run

MiB = 1 << 20

# One 256 MiB chunk under a 50 ms stall budget: the fake's calls are quick, so it is registered
# in three pieces (16 MiB probe, then at most 4x the last: 64 MiB, then the 176 MiB left).
# Register call k fails: the first, middle or last piece.
PIECE_FAILURES = [pytest.param(1, id="first-piece"), pytest.param(2, id="middle-piece"),
                  pytest.param(3, id="last-piece")]  # fmt: skip


def gauge(registry: CollectorRegistry, pool: PinnedPool) -> float | None:
    return registry.get_sample_value("pinpool_pinned_bytes", {"pool": pool.name, "runtime": pool.runtime.name})


def prefix_of(ranges: list[Chunk]) -> int:
    """Where the contiguous run of ``ranges`` from offset 0 ends."""
    end = 0
    for chunk in sorted(ranges, key=lambda c: c.offset):
        if chunk.offset != end:
            break
        end = chunk.end
    return end


def assert_counts_agree(pool: PinnedPool, registry: CollectorRegistry, runtime_books: dict[int, int]) -> None:
    """The pool's figures agree with each other, the gauge and the runtime's own books."""
    base = pool.data_ptr
    registrations = pool.registrations
    assert {(c.offset, c.nbytes) for c in registrations} == {(p - base, n) for p, n in runtime_books.items()}
    registered = sum(c.nbytes for c in registrations)
    assert pool.pinned_bytes <= registered
    assert (gauge(registry, pool) or 0) == pool.pinned_bytes
    assert pool.plan.page_bytes == 1  # raw: pages are bytes, so the prefix is a byte count
    assert pool.pinned_pages <= pool.pinned_bytes


async def enter(pool: PinnedPool, mode: str) -> None:
    """Enter and leave a foreground pool (whose pinning fails on entry)."""
    if mode == "async":
        async with pool:
            raise AssertionError("entered a pool whose pinning failed")
    with pool:
        raise AssertionError("entered a pool whose pinning failed")


def piece_pool(fake: FakeRuntime, registry: CollectorRegistry, background: bool, name: str) -> PinnedPool:
    return PinnedPool(
        size=256 * MiB, max_chunk_bytes=256 * MiB, runtime=fake, registry=registry, name=name, populate=False,
        register_workers=1, max_retries=0, max_call_seconds=0.05, background=background,
    )  # fmt: skip


@pytest.mark.anyio
@each_driver
@pytest.mark.parametrize("failing", PIECE_FAILURES)
async def test_background_failure_on_a_piece_keeps_and_counts_what_is_registered(mode: str, failing: int) -> None:
    fake, registry = FakeRuntime(fail_register_on=failing), CollectorRegistry()
    pool = piece_pool(fake, registry, background=True, name=f"counts-bg-{failing}")
    error: PinError | None = None

    def body(pool: PinnedPool) -> None:
        nonlocal error
        with pytest.raises(PinError) as raised:
            pool.wait_ready_sync(timeout=30)
        error = raised.value
        assert pool.state is PoolState.FAILED
        assert len(fake.register_calls) == failing  # pinning stopped at the failed piece
        kept = list(pool.registrations)
        assert len(kept) == failing - 1
        assert_counts_agree(pool, registry, fake.registered)
        # Under the CUDA order every registered piece is pinned, the pages included.
        assert pool.pinned_bytes == sum(fake.registered.values()) == sum(c.nbytes for c in kept)
        assert pool.pinned_pages == prefix_of(kept) == pool.pinned_bytes
        text = str(error)
        assert f"pages [0, {pool.pinned_pages}) of {pool.num_pages}" in text
        assert f"({format_bytes(pool.pinned_bytes)} pinned, {len(kept)} registration(s) of " in text
        assert "not pinned" not in text
        if kept:
            pool.tensor[: pool.pinned_pages].fill_(3)  # the pages said pinned are usable

    await pin_and_run(pool, mode, body)
    assert error is not None
    assert pool.pinned_bytes == 0 and pool.pinned_pages == 0 and pool.registrations == ()
    assert fake.registered == {} and gauge(registry, pool) is None


@pytest.mark.anyio
@each_driver
@pytest.mark.parametrize("failing", PIECE_FAILURES)
async def test_foreground_failure_on_a_piece_rolls_back_every_count(mode: str, failing: int) -> None:
    fake, registry = FakeRuntime(fail_register_on=failing), CollectorRegistry()
    pool = piece_pool(fake, registry, background=False, name=f"counts-fg-{failing}")
    seen: list[tuple[int, int, int]] = []

    def before_unregister(op: str, ptr: int, nbytes: int) -> None:
        if op == "unregister" and not seen:  # the rollback's first call: the books before it
            seen.append((lifecycle_of(pool).session.ledger.pinned_bytes, sum(fake.registered.values()),  # type: ignore[union-attr]
                         int(gauge(registry, pool) or 0)))  # fmt: skip

    fake.before_call = before_unregister
    with pytest.raises(PinError, match="every registered chunk was rolled back"):
        await enter(pool, mode)
    if failing > 1:  # pieces were registered: counted, in the gauge too, until the rollback undid them
        assert seen and seen[0][0] == seen[0][1] == seen[0][2] > 0
    assert pool.pinned_bytes == 0 and pool.pinned_pages == 0 and pool.registrations == ()
    assert fake.registered == {} and gauge(registry, pool) is None
    assert len(fake.unregister_calls) == failing - 1


@pytest.mark.anyio
@each_driver
@pytest.mark.parametrize("background", [True, False], ids=["background", "foreground"])
async def test_a_fault_failing_after_registration_counts_only_what_is_faulted(mode: str, background: bool) -> None:
    """Lock-on-fault: chunks are registered before they are faulted; the 3rd span's fault fails.
    Registered chunks stay registered (listed), only faulted ones are pinned (counted, in the
    prefix, in the gauge), and the text says how much is registered but not pinned."""
    fake, registry = FakeRuntime(lock_on_fault=True, fail_populate_on=3), CollectorRegistry()
    pool = PinnedPool(
        size=64 * MiB, chunk_bytes=16 * MiB, runtime=fake, registry=registry, name=f"counts-fault-{background}",
        register_workers=1, populate_workers=1, max_retries=0, max_call_seconds=None, background=background,
    )  # fmt: skip
    if not background:
        with pytest.raises(PinError, match="populate"):
            await enter(pool, mode)
    else:

        def body(pool: PinnedPool) -> None:
            with pytest.raises(PinError) as raised:
                pool.wait_ready_sync(timeout=30)
            assert_counts_agree(pool, registry, fake.registered)
            assert pool.pinned_bytes == pool.stats.populated_bytes == 32 * MiB  # two chunks faulted, so locked
            assert pool.pinned_pages == 32 * MiB
            registered = sum(c.nbytes for c in pool.registrations)
            assert registered >= 48 * MiB  # the failed chunk's registration at least: kept until exit
            text = str(raised.value)
            assert f"(32 MiB pinned, {len(pool.registrations)} registration(s) of {format_bytes(registered)} " in text
            assert f"{format_bytes(registered - 32 * MiB)} of them locked on fault but not faulted in" in text

        if mode == "async":
            async with pool as entered:
                body(entered)
        else:
            with pool as entered:
                body(entered)
    assert pool.pinned_bytes == 0 and pool.pinned_pages == 0 and pool.registrations == ()
    assert fake.registered == {} and gauge(registry, pool) is None


# -- the real kernel ---------------------------------------------------------------------------------------


class _FailingMlock(pinpool.runtimes.MlockRuntime):
    """The real mlock runtime; its ``lock_on``-th lock call, or its ``fault_on``-th fault (populate:
    declared here, so the engine calls it), fails as a host out of memory would."""

    def __init__(self, *, lock_on: int = 0, fault_on: int = 0) -> None:
        super().__init__()
        self.capabilities = dataclasses.replace(type(self).capabilities, populates=True)
        self._locks, self._faults, self._lock_on, self._fault_on = 0, 0, lock_on, fault_on

    @staticmethod
    def _fail(op: str, ptr: int, nbytes: int) -> pinpool.RuntimeCallError:
        return pinpool.RuntimeCallError(op=op, code=12, reason="ENOMEM", message="injected", ptr=ptr, nbytes=nbytes)

    def lock_on_fault(self, ptr: int, nbytes: int) -> None:
        self._locks += 1
        if self._locks == self._lock_on:
            raise self._fail("mlock2", ptr, nbytes)
        super().lock_on_fault(ptr, nbytes)

    def populate(self, ptr: int, nbytes: int) -> None:
        self._faults += 1
        if self._faults == self._fault_on:
            raise self._fail("madvise(MADV_POPULATE_WRITE)", ptr, nbytes)
        populate_range(ptr, nbytes)


@needs_mlock
@pytest.mark.parametrize(
    ("failure", "chunk_mib", "budget"),
    [
        pytest.param({"lock_on": 2}, 64, 0.05, id="middle-piece"),  # 16 MiB pieces (the probe size)
        pytest.param({"lock_on": 3}, 16, None, id="third-chunk"),
        pytest.param({"fault_on": 3}, 16, None, id="fault-after-registration"),
    ],
)
def test_mlock_background_failure_counts_agree_with_vmlck(
    vmlck_baseline: int, failure: dict[str, int], chunk_mib: int, budget: float | None
) -> None:
    runtime, registry = _FailingMlock(**failure), CollectorRegistry()
    pool = PinnedPool(
        size=64 * MiB, max_chunk_bytes=chunk_mib * MiB, runtime=runtime, registry=registry, name="counts-mlock",
        register_workers=1, populate_workers=1, max_retries=0, max_call_seconds=budget, background=True,
    )  # fmt: skip
    with pool:
        with pytest.raises(PinError) as raised:
            pool.wait_ready_sync(timeout=30)
        assert_counts_agree(pool, registry, runtime.registered)
        registered = sum(c.nbytes for c in pool.registrations)
        assert registered > 0
        # The kernel counts a lock-on-fault range in VmLck whole from its mlock2 call; only its
        # faulted pages are pinned (pinned_bytes), and the text tells the two apart.
        assert locked_bytes() - vmlck_baseline == registered
        assert pool.pinned_bytes == pool.stats.populated_bytes
        text = str(raised.value)
        assert f"({format_bytes(pool.pinned_bytes)} pinned, {len(pool.registrations)} registration(s) of " in text
        if registered > pool.pinned_bytes:
            assert f"{format_bytes(registered - pool.pinned_bytes)} of them locked on fault but not faulted in" in text
        pool.tensor[: pool.pinned_pages].fill_(1)
    assert pool.pinned_bytes == 0 and pool.pinned_pages == 0 and pool.registrations == ()
    assert locked_bytes() == vmlck_baseline and gauge(registry, pool) is None
