"""pinpool.pin(): pinning a tensor the caller allocated, with the pool's guarantees."""

from __future__ import annotations

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pinpool
from pinpool._host import libc as _libc
from pinpool._plan import plan_chunks
from pinpool.testing import FakeRuntime, locked_bytes

from ..conftest import each_driver, needs_mlock

MiB = 1 << 20
PAGE = _libc.PAGE_SIZE

pytestmark = pytest.mark.anyio


def unaligned_tensor(nbytes: int, misalignment: int = 64) -> torch.Tensor:
    backing = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
    start = (-backing.data_ptr()) % PAGE + misalignment
    return backing[start : start + nbytes]


@needs_mlock
@each_driver
async def test_pin_locks_the_callers_tensor_and_never_frees_it(mode: str, vmlck_baseline: int) -> None:
    t = unaligned_tensor(32 * MiB)
    t.fill_(5)
    pinned = pinpool.pin(t, runtime="mlock", chunk_bytes=8 * MiB, register_workers=2)
    if mode == "async":
        async with pinned as p:
            locked = locked_bytes() - vmlck_baseline
            assert p.tensor.data_ptr() == t.data_ptr() and p.tensor.shape == t.shape
    else:
        with pinned as p:
            locked = locked_bytes() - vmlck_baseline
            assert p.tensor.data_ptr() == t.data_ptr()
    # every page the tensor touches is locked: one more than its size in pages, as it is unaligned
    assert locked == (32 * MiB // PAGE + 1) * PAGE
    assert locked_bytes() == vmlck_baseline
    assert len(pinned.plan.chunks) == 5  # a short head chunk up to the first page boundary, then 8 MiB steps
    assert all((t.data_ptr() + c.offset) % PAGE == 0 for c in pinned.plan.chunks[1:])
    assert int(t.sum()) == 5 * 32 * MiB  # the caller's memory is intact and still usable


@needs_mlock
def test_pin_keeps_tensor_shape_and_dtype(vmlck_baseline: int) -> None:
    t = torch.zeros(4, 1024, 256, dtype=torch.float32)
    with pinpool.pin(t, runtime="mlock", granularity_bytes=256 * 4) as p:
        assert p.tensor.shape == (4, 1024, 256) and p.tensor.dtype == torch.float32
        p.tensor[1, 2, 3] = 7.0
        assert p.plan.granularity == 1024
    assert float(t[1, 2, 3]) == 7.0


@needs_mlock
def test_pinning_a_range_pinpool_already_pins_changes_nothing(vmlck_baseline: int) -> None:
    with pinpool.PinnedPool(size=8 * MiB, runtime="mlock") as pool:
        fake = FakeRuntime()
        with (
            pytest.raises(pinpool.AlreadyPinnedError, match="already pins"),
            pinpool.pin(pool.tensor[MiB:], runtime=fake),
        ):
            pytest.fail("must not enter")
        assert fake.register_calls == []
        assert locked_bytes() - vmlck_baseline == 8 * MiB
    assert locked_bytes() == vmlck_baseline


@needs_mlock
def test_pinning_memory_locked_outside_pinpool_changes_nothing(vmlck_baseline: int) -> None:
    t = unaligned_tensor(4 * MiB, misalignment=0)
    assert _libc.mlock(t.data_ptr(), t.numel()) == 0
    try:
        with pytest.raises(pinpool.AlreadyPinnedError, match="outside pinpool"), pinpool.pin(t, runtime="mlock"):
            pytest.fail("must not enter")
        assert locked_bytes() - vmlck_baseline == 4 * MiB
    finally:
        _libc.munlock(t.data_ptr(), t.numel())
    with pinpool.pin(t, runtime="mlock"):  # and once unlocked, it can be pinned
        assert locked_bytes() - vmlck_baseline == 4 * MiB


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_pin_rolls_back_on_failure(fail_at: int) -> None:
    t = unaligned_tensor(16 * MiB)
    fake = FakeRuntime(fail_register_on=fail_at)
    with (
        pytest.raises(pinpool.PinError),
        pinpool.pin(t, runtime=fake, chunk_bytes=4 * MiB, register_workers=1, max_retries=0),
    ):
        pytest.fail("must not enter")
    assert fake.registered == {}
    assert len(fake.unregister_calls) == fail_at - 1
    with pinpool.pin(t, runtime=FakeRuntime()):  # nothing of the failed pin is left claimed
        pass


async def test_pin_cancellation_rolls_back() -> None:
    t = unaligned_tensor(64 * MiB, misalignment=0)
    fake = FakeRuntime(register_delay=0.01)

    async def cancel_once_registering(scope: anyio.CancelScope) -> None:
        # Once a registration is in, not after a fixed time: a loaded host may not have started one.
        while not fake.register_calls:  # noqa: ASYNC110 - the call lands on a pin worker thread
            await anyio.sleep(0.001)
        scope.cancel()

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(cancel_once_registering, scope)
            async with pinpool.pin(t, runtime=fake, chunk_bytes=MiB, register_workers=2):
                pytest.fail("must not enter")
    assert scope.cancelled_caught and fake.registered == {}
    assert 0 < len(fake.register_calls) < 64


def test_pin_populate_on_unaligned_tensor(fake: FakeRuntime) -> None:
    t = unaligned_tensor(8 * MiB)
    with pinpool.pin(t, runtime=fake, chunk_bytes=2 * MiB, populate=True) as p:
        assert len(fake.registered) == len(p.plan.chunks) == 5


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        ("not a tensor", "expected a torch.Tensor"),
        (torch.zeros(8, 8).t(), "not contiguous"),
        (torch.zeros(0), "no elements"),
        (torch.zeros(4, device="meta"), "only CPU tensors"),
    ],
)
def test_pin_rejects_bad_tensors(fake: FakeRuntime, tensor: object, match: str) -> None:
    with pytest.raises(pinpool.ConfigError, match=match):
        pinpool.pin(tensor, runtime=fake)  # type: ignore[arg-type]


def test_unaligned_tensor_with_impossible_granularity_is_a_config_error_without_exact_ranges() -> None:
    """A runtime that pins whole pages uncounted (exact_ranges=False) cannot let chunks share one."""
    t = unaligned_tensor(16 * MiB, misalignment=64)
    with pytest.raises(pinpool.ConfigError, match=r"allocate it page-aligned \(pinpool.empty"):
        pinpool.pin(t, runtime=FakeRuntime(exact_ranges=False), granularity_bytes=PAGE, chunk_bytes=4 * MiB)
    single = pinpool.pin(t, runtime=FakeRuntime(exact_ranges=False), granularity_bytes=PAGE)  # one call: no boundary
    assert len(single.plan.chunks) == 1
    # exact byte ranges (CUDA, mlock, the default fake): the same tensor is cut from its start
    shared = pinpool.pin(t, runtime=FakeRuntime(), granularity_bytes=PAGE, chunk_bytes=4 * MiB)
    assert [c.nbytes for c in shared.plan.chunks] == [4 * MiB] * 4


@settings(max_examples=300, deadline=None)
@given(
    nbytes=st.integers(1, 1 << 26),
    granularity=st.one_of(st.none(), st.sampled_from([1, 2, 3, 8, 60, 64, 256, 1000, 4096])),
    start=st.integers(0, PAGE - 1),
    limit_pages=st.integers(1, 64),
)
def test_unaligned_start_plans_keep_every_boundary_aligned(
    nbytes: int, granularity: int | None, start: int, limit_pages: int
) -> None:
    limit = limit_pages * PAGE * (granularity or 1)
    try:
        plan = plan_chunks(nbytes, granularity=granularity, limit=limit, page_size=PAGE, start=start)
    except pinpool.ConfigError:
        # only when no multiple of the granularity lands on a page boundary from this start
        g = granularity or 1
        assert nbytes > limit
        assert all((start + b) % PAGE for b in range(g, g * PAGE + 1, g))
        return
    offsets = [c.offset for c in plan.chunks]
    assert offsets[0] == 0 and sum(c.nbytes for c in plan.chunks) == nbytes
    assert all(a.end == b.offset for a, b in zip(plan.chunks, plan.chunks[1:], strict=False))
    assert all(c.nbytes <= limit for c in plan.chunks)
    for boundary in offsets[1:]:
        assert (start + boundary) % PAGE == 0
        assert boundary % (granularity or 1) == 0
