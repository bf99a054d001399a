"""The suite's fault matrix, run through pinpool's real CUDA runtime code on CPU:
``CudaRuntime.from_binding(FakeCudart())`` (error-code mapping, sticky-error clearing, the
device context) over real page locks. Each scenario (a failed registration and its rollback,
retry with halving, cancellation, a failed teardown, a background failure, an interrupt) ends
with nothing on the fake's books, no sticky error left in this thread and VmLck where it was."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import pinpool
from pinpool.runtimes import CudaRuntime
from pinpool.testing import FakeCudart, locked_bytes

from ..conftest import each_driver, needs_mlock, pin_and_run

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
