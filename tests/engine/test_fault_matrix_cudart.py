"""The suite's fault matrix, run through pinpool's real CUDA runtime code on CPU:
``CudaRuntime.from_binding(FakeCudart())`` (error-code mapping, sticky-error clearing, the
device context) over real page locks. Each scenario (a failed registration and its rollback,
retry with halving, cancellation, a failed teardown, a background failure, an interrupt) ends
with nothing on the fake's books, no sticky error left in this thread and VmLck where it was."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import structlog

import pinpool
from pinpool.runtimes import CudaRuntime
from pinpool.testing import FakeCudart, locked_bytes

from ..conftest import each_driver, mapped, needs_mlock, pin_and_run

MiB = 1 << 20

pytestmark = [pytest.mark.anyio, needs_mlock]


@pytest.fixture
def fake(vmlck_baseline: int) -> Iterator[FakeCudart]:
    """A fresh stand-in; afterwards its books are empty and VmLck is back to its value."""
    fake = FakeCudart()
    yield fake
    assert fake.registered == {}
    assert fake.cudaGetLastError() == 0  # the runtime cleared every failure it saw in this thread
    assert locked_bytes() == vmlck_baseline


def pool_on(fake: FakeCudart, **options: object) -> pinpool.PinnedPool:
    kwargs: dict[str, object] = {"size": 32 * MiB, "chunk_bytes": 8 * MiB, "registry": None, "register_workers": 1}
    kwargs.update(options)
    return pinpool.PinnedPool(runtime=CudaRuntime.from_binding(fake), **kwargs)  # type: ignore[arg-type]


@each_driver
@pytest.mark.parametrize("nth", [1, 3, 4])
async def test_a_failed_registration_rolls_back(fake: FakeCudart, mode: str, nth: int) -> None:
    calls = iter(range(1, 100))
    fake.fail("register", 1, when=lambda _p, _n: next(calls) == nth)  # cudaErrorInvalidValue: not retried
    with pytest.raises(pinpool.PinError) as info:
        await pin_and_run(pool_on(fake, max_retries=0), mode)
    assert "cudaErrorInvalidValue" in str(info.value) and info.value.leaked == ()
    assert [rc for op, _p, _n, rc in fake.calls if op == "register"][-1] == 1


@each_driver
async def test_retry_with_halving_under_a_driver_cap(fake: FakeCudart, mode: str) -> None:
    fake.refuse_above(4 * MiB, rc=2)  # cudaErrorMemoryAllocation: retryable for CUDA
    registered: list[int] = []
    await pin_and_run(
        pool_on(fake, min_chunk_bytes=2 * MiB), mode, lambda pool: registered.extend(fake.registered.values())
    )
    assert registered and max(registered) <= 4 * MiB and sum(registered) == 32 * MiB


@each_driver
async def test_on_progress_raising_cancels_and_rolls_back(fake: FakeCudart, mode: str) -> None:
    def stop(pinned: int, total: int, done: int, chunks: int) -> None:
        if done >= 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await pin_and_run(pool_on(fake, on_progress=stop), mode)


@each_driver
async def test_a_failed_teardown_is_an_unpin_error_and_keeps_only_that_chunk(fake: FakeCudart, mode: str) -> None:
    fake.fail("unregister", 2, times=1)
    with pytest.raises(pinpool.UnpinError, match="1 chunk\\(s\\) failed to unregister"):
        await pin_and_run(pool_on(fake), mode)
    (base,) = fake.registered  # the one whose unregister failed stays registered (and locked)
    assert fake.cudaHostUnregister(base) == 0  # release it by hand, as a retry would


async def test_a_background_failure_keeps_the_prefix_then_exit_releases_all(fake: FakeCudart) -> None:
    calls = iter(range(1, 100))
    fake.fail("register", 999, when=lambda _p, _n: next(calls) == 3)  # cudaErrorUnknown
    pool = pool_on(fake, background=True, max_retries=0)
    with pytest.raises(pinpool.PinError, match="cudaErrorUnknown"):
        async with pool:
            with pytest.raises(pinpool.PinError):
                await pool.wait_ready()
            assert len(fake.registered) == 2  # nothing is unpinned under the body
            raise pool.error  # type: ignore[misc]


@each_driver
@pytest.mark.parametrize("rc", [1, 999])
async def test_a_registration_that_registered_then_returned_a_code_is_undone(
    fake: FakeCudart, mode: str, rc: int
) -> None:
    """Issue 33 item 4: CUDA calls "may also return error codes from previous, asynchronous launches".
    A register that registered, then answered a code, was believed: 8 MiB stayed registered and
    locked after "every registered chunk was rolled back", leaked=()."""
    calls = iter(range(1, 100))
    fake.fail("register", rc, when=lambda _p, _n: next(calls) == 3, applied=True)
    with structlog.testing.capture_logs() as logs:
        pool = pool_on(fake, max_retries=0)
        with pytest.raises(pinpool.PinError) as info:
            await pin_and_run(pool, mode)
    assert info.value.leaked == () and info.value.code == rc
    (undone,) = [e for e in logs if e["event"] == "chunk.registered_despite_code"]
    assert undone["log_level"] == "warning" and undone["code"] == rc and undone["offset"] == 16 * MiB
    address = fake.calls[0][1]
    del pool, info
    gc.collect()
    assert not mapped(address)  # nothing kept mapped: nothing may still be pinned
    # the fixture: nothing on the binding's books, no sticky error, VmLck back


@each_driver
async def test_a_retried_registration_that_had_registered_is_undone_before_its_halves(
    fake: FakeCudart, mode: str
) -> None:
    """A retryable code after the call registered: undone first, so the halves do not meet 712."""
    calls = iter(range(1, 100))
    fake.fail("register", 2, when=lambda _p, _n: next(calls) == 2, applied=True)
    sizes: list[int] = []
    await pin_and_run(pool_on(fake), mode, lambda pool: sizes.extend(sorted(fake.registered.values())))
    assert sizes == [4 * MiB, 4 * MiB, 8 * MiB, 8 * MiB, 8 * MiB]
    assert not [rc for op, _p, _n, rc in fake.calls if rc == 712]


@each_driver
async def test_a_registration_that_cannot_be_checked_is_undone_at_rollback(fake: FakeCudart, mode: str) -> None:
    """The checking unregister fails too: the range may be registered, so the rollback undoes it."""
    calls = iter(range(1, 100))
    fake.fail("register", 1, when=lambda _p, _n: next(calls) == 3, applied=True)
    fake.fail("unregister", 999)  # the first unregister is the check
    with pytest.raises(pinpool.PinError) as info:
        await pin_and_run(pool_on(fake, max_retries=0), mode)
    assert info.value.leaked == ()
    assert [rc for op, _p, _n, rc in fake.calls if op == "unregister"].count(0) == 3  # two pinned, one maybe
