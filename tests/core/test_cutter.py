"""Retry with halving: a registration failing with a retryable code is split into aligned halves."""

from __future__ import annotations

import itertools
import math

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

import pinpool
from pinpool import layouts
from pinpool._plan import Chunk, RetryGrid, RetrySplitter
from pinpool.testing import FakeRuntime

from ..conftest import each_driver, pin_and_run

MiB = 1 << 20
pytestmark = pytest.mark.anyio


def registered_table(fake: FakeRuntime, base: int) -> list[Chunk]:
    return sorted(Chunk(ptr - base, n) for ptr, n in fake.registered.items())


@each_driver
async def test_a_capped_driver_gets_halves_and_the_pool_opens(mode: str) -> None:
    fake = FakeRuntime(fail_register_larger_than=300 * MiB)
    registry = CollectorRegistry()
    seen: list[list[Chunk]] = []

    def body(p: pinpool.PinnedPool) -> None:
        seen.append(registered_table(fake, p.data_ptr))
        assert p.pinned_bytes == 1 << 30

    with structlog.testing.capture_logs() as logs:
        pool = pinpool.PinnedPool(
            size="1GiB", chunk_bytes="512MiB", runtime=fake, registry=registry, populate=False, name="retry"
        )
        await pin_and_run(pool, mode, body)
    assert seen == [[Chunk(i * 256 * MiB, 256 * MiB) for i in range(4)]]
    assert pool.stats.retries == 2
    assert registry.get_sample_value("pinpool_retries_total", {"pool": "retry", "runtime": "fake"}) == 2
    retries = [e for e in logs if e["event"] == "chunk.retry"]
    assert sorted(e["offset"] for e in retries) == [0, 512 * MiB]
    assert all(e["halves"] == [256 * MiB, 256 * MiB] and e["code"] == 2 for e in retries)
    assert fake.registered == {}  # every piece unregistered by its own base
    assert len(fake.unregister_calls) == 4


async def test_the_floor_ends_retries_and_the_error_lists_every_attempt() -> None:
    fake = FakeRuntime(fail_register_larger_than=10 * MiB)
    pool = pinpool.PinnedPool(
        size="512MiB", chunk_bytes="512MiB", runtime=fake, registry=None, populate=False, min_chunk_bytes="64MiB"
    )
    with pytest.raises(pinpool.PinError, match="retries with aligned halves") as info:
        with pool:
            pytest.fail("body must not run")
    sizes = [f.chunk.nbytes for f in info.value.failures]
    assert sizes == [512 * MiB, 256 * MiB, 128 * MiB, 64 * MiB]  # 64 MiB cannot halve above the 64 MiB floor
    assert pool.stats.retries == 3
    assert fake.registered == {}


async def test_pieces_registered_before_the_floor_are_rolled_back() -> None:
    # The whole chunk fails, its first half registers, then nothing does: the second half fails at the floor.
    calls: list[int] = []

    class Capped(FakeRuntime):
        def register(self, ptr: int, nbytes: int) -> None:
            calls.append(nbytes)
            if len(calls) > 2:  # the whole chunk fails (1), its first half registers (2), then nothing does
                raise pinpool.RuntimeCallError(
                    op="cudaHostRegister", code=2, reason="cudaErrorMemoryAllocation", message="out", ptr=ptr,
                    nbytes=nbytes,
                )  # fmt: skip
            if len(calls) == 1:
                raise pinpool.RuntimeCallError(
                    op="cudaHostRegister", code=2, reason="cudaErrorMemoryAllocation", message="cap", ptr=ptr,
                    nbytes=nbytes,
                )  # fmt: skip
            super().register(ptr, nbytes)

    capped = Capped()
    pool = pinpool.PinnedPool(
        size="512MiB", chunk_bytes="512MiB", runtime=capped, registry=None, populate=False, min_chunk_bytes="128MiB"
    )
    with pytest.raises(pinpool.PinError) as info:
        with pool:
            pytest.fail("body must not run")
    assert capped.registered == {}  # the registered first half was undone by the rollback
    assert len(capped.unregister_calls) == 1
    assert [f.chunk.nbytes for f in info.value.failures] == [512 * MiB, 256 * MiB, 128 * MiB]


async def test_non_retryable_codes_fail_at_once() -> None:
    fake = FakeRuntime(fail_register_on=1)  # code 2 but...
    fake.capabilities = pinpool.runtimes.Capabilities(populates=True)  # ...this runtime declares nothing retryable
    pool = pinpool.PinnedPool(size="256MiB", chunk_bytes="256MiB", runtime=fake, registry=None, populate=False)
    with pytest.raises(pinpool.PinError) as info:
        with pool:
            pass
    assert len(info.value.failures) == 1 and pool.stats.retries == 0
    assert len(fake.register_calls) == 1


async def test_max_retries_zero_never_retries() -> None:
    fake = FakeRuntime(fail_register_larger_than=100 * MiB)
    pool = pinpool.PinnedPool(
        size="256MiB", chunk_bytes="256MiB", runtime=fake, registry=None, populate=False, max_retries=0
    )
    with pytest.raises(pinpool.PinError):
        with pool:
            pass
    assert len(fake.register_calls) == 1 and pool.stats.retries == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_max_retries_is_validated(fake: FakeRuntime, bad: object) -> None:
    with pytest.raises(pinpool.ConfigError, match="max_retries"):
        pinpool.PinnedPool(size="64MiB", runtime=fake, max_retries=bad)  # type: ignore[arg-type]


def test_min_chunk_bytes_is_validated(fake: FakeRuntime) -> None:
    with pytest.raises(pinpool.ConfigError, match="min_chunk_bytes"):
        pinpool.PinnedPool(size="64MiB", runtime=fake, min_chunk_bytes="-5MiB")


@settings(max_examples=60, deadline=None)
@given(
    granularity=st.sampled_from([None, 4096, 3 * 4096, 300 * 1024, 5 * MiB]),
    chunk_mib=st.integers(2, 64),
    cap_mib=st.integers(1, 64),
    floor_mib=st.integers(1, 8),
    pages=st.integers(1, 40),
)
def test_retried_tables_keep_every_planning_invariant(
    granularity: int | None, chunk_mib: int, cap_mib: int, floor_mib: int, pages: int
) -> None:
    page = granularity or MiB
    fake = FakeRuntime(fail_register_larger_than=cap_mib * MiB)
    try:
        pool = pinpool.PinnedPool(
            layout=layouts.Raw(granularity_bytes=granularity), size=pages * page,
            chunk_bytes=chunk_mib * MiB, runtime=fake, registry=None, populate=False, register_workers=1,
            min_chunk_bytes=floor_mib * MiB, max_retries=64,
        )  # fmt: skip
    except pinpool.ConfigError:
        return  # e.g. a granularity above the chunk size: refused before anything is pinned
    unit = math.lcm(granularity or 1, 4096)
    try:
        with pool:
            table = registered_table(fake, pool.data_ptr)
    except pinpool.PinError as error:
        assert fake.registered == {}
        assert pool.stats.retries <= 64
        assert all(f.error.code == 2 for f in error.failures)
        return
    assert table[0].offset == 0 and table[-1].end == pool.nbytes
    assert all(a.end == b.offset for a, b in itertools.pairwise(table))  # contiguous, no overlap
    assert all(c.offset % unit == 0 for c in table)  # every boundary on the aligned grid
    assert all(c.nbytes <= min(chunk_mib, cap_mib) * MiB for c in table)
    assert len(table) == len(pool.plan.chunks) + pool.stats.retries  # each retry turns one range into two
    assert fake.registered == {}


def test_splitter_halves_on_the_grid_and_respects_the_floor() -> None:
    splitter = RetrySplitter((RetryGrid(0, 10 * MiB, 3 * 4096, 0),), floor_bytes=MiB)
    halves = splitter.split(Chunk(0, 10 * MiB))
    assert halves is not None
    low, high = halves
    assert low.offset == 0 and low.end == high.offset and high.end == 10 * MiB
    assert high.offset % (3 * 4096) == 0 and low.nbytes >= MiB and high.nbytes >= MiB
    assert splitter.split(Chunk(0, MiB + 4096)) is None  # halves would be below the floor
    unaligned = RetrySplitter((RetryGrid(0, 10 * MiB, 4096, 64),), floor_bytes=4096)
    cut = unaligned.split(Chunk(0, 64 + 8 * 4096))
    assert cut is not None and (cut[1].offset - 64) % 4096 == 0  # the grid starts at the first boundary
