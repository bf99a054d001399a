"""pinpool.pin() with every feature PinnedPool has that makes sense for a caller's tensor:
background pinning and readiness, the stall budget with PinnedPool's default, node pacing,
retries, and one construction path (PinnedPool._build) for both."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

import pinpool
from pinpool import PoolState
from pinpool._errors import NodeBusyError
from pinpool._pool import PinnedPool
from pinpool.testing import FakeRuntime, locked_bytes

from ..conftest import each_driver, lifecycle_of, needs_mlock

MiB = 1 << 20

pytestmark = pytest.mark.anyio


def rows(count: int = 64, row_bytes: int = MiB) -> torch.Tensor:
    """Page-aligned rows (pinpool.empty reads as zeros), so chunks are whole rows."""
    return pinpool.empty(count, row_bytes, dtype=torch.uint8)


def test_pin_has_pinned_pools_stall_budget_default() -> None:
    """max_call_seconds="auto": 50 ms in the background, none in the foreground, as PinnedPool."""
    t = rows(4)
    for background, budget in ((False, None), (True, 0.05)):
        pinned = pinpool.pin(t, runtime=FakeRuntime(), registry=None, background=background)
        pool = pinpool.PinnedPool(size=t.nbytes, runtime=FakeRuntime(), registry=None, background=background)
        assert lifecycle_of(pinned).options.max_call_seconds == lifecycle_of(pool).options.max_call_seconds == budget
        assert lifecycle_of(pinned).options.pin_nice == lifecycle_of(pool).options.pin_nice


def test_pin_goes_through_pinned_pools_construction_path() -> None:
    """One path: pin() builds its request from its options and hands it to PinnedPool._build."""
    t = rows(4)
    with mock.patch.object(PinnedPool, "_build", autospec=True) as build:
        pinpool.pin(t, runtime="mlock", max_retries=2, node_wait=False, name="kv", node_slots=2)
    (_pool, request), _ = build.call_args
    assert request.source.data_ptr() == t.data_ptr() and request.runtime == "mlock"
    options = request.options
    assert options.max_retries == 2 and options.name == "kv" and options.background is False
    assert options.layout.page_bytes == t[0].nbytes and options.size == t.nbytes
    assert request.pacing.wait is False and request.pacing.slots == 2


def test_pins_pages_are_the_tensors_rows() -> None:
    pinned = pinpool.pin(rows(8, 4096), runtime=FakeRuntime(), registry=None)
    assert (pinned.num_pages, pinned.plan.page_bytes, pinned.nbytes) == (8, 4096, 8 * 4096)
    scalar = pinpool.pin(torch.zeros((), dtype=torch.float64), runtime=FakeRuntime(), registry=None)
    assert (scalar.num_pages, scalar.plan.page_bytes) == (1, 8)


@each_driver
async def test_pin_in_the_background_under_the_fake_runtime(mode: str) -> None:
    t = rows(64)
    t[5].fill_(7)
    fake = FakeRuntime(register_delay=0.01)
    pinned = pinpool.pin(t, runtime=fake, registry=None, chunk_bytes="4MiB", register_workers=1, populate=False,
                         background=True, name="bg")  # fmt: skip
    if mode == "async":
        async with pinned as p:
            assert p.state in (PoolState.PINNING, PoolState.READY)  # the body runs while it pins
            assert await p.wait_ready(min_bytes="8MiB") >= 8  # the first 8 rows, at least
            assert await p.wait_ready() == 64 and p.state is PoolState.READY
            assert int(p.tensor[5].sum()) == 7 * MiB and p.tensor.data_ptr() == t.data_ptr()
    else:
        with pinned as p:
            assert p.state in (PoolState.PINNING, PoolState.READY)
            assert p.wait_ready_sync(fraction=0.25, timeout=60) >= 16
            assert p.wait_ready_sync(timeout=60) == 64 and p.state is PoolState.READY
            assert int(p.tensor[5].sum()) == 7 * MiB
    assert fake.registered == {} and pinned.state is PoolState.CLOSED
    assert sum(n for _ptr, n in fake.register_calls) == 64 * MiB


@needs_mlock
@each_driver
async def test_pin_in_the_background_under_mlock(mode: str, vmlck_baseline: int) -> None:
    t = pinpool.empty(32, MiB, dtype=torch.uint8)  # page-aligned: VmLck is exactly its size
    pinned = pinpool.pin(t, runtime="mlock", registry=None, chunk_bytes="4MiB", background=True)
    if mode == "async":
        async with pinned as p:
            assert await p.wait_ready() == 32
            locked = locked_bytes() - vmlck_baseline
    else:
        with pinned as p:
            assert p.wait_ready_sync(timeout=60) == 32
            locked = locked_bytes() - vmlck_baseline
    assert locked == 32 * MiB
    assert locked_bytes() == vmlck_baseline


def test_a_failed_background_pin_keeps_what_it_pinned_until_exit() -> None:
    fake = FakeRuntime(fail_register_on=3)
    pinned = pinpool.pin(rows(16), runtime=fake, registry=None, chunk_bytes="2MiB", register_workers=1,
                         populate=False, background=True, max_retries=0, max_call_seconds=None)  # fmt: skip
    with pinned as p:
        with pytest.raises(pinpool.PinError):
            p.wait_ready_sync(timeout=60)  # the waiter gets the failure (so exiting does not raise it again)
        assert p.state is PoolState.FAILED and p.pinned_pages == 4  # two chunks of 2 rows
        assert len(fake.registered) == 2  # kept, usable, until exit
    assert fake.registered == {}


def test_pin_with_node_pacing_admits_and_releases(tmp_path: Path) -> None:
    t = rows(4)
    pinned = pinpool.pin(t, runtime=FakeRuntime(), registry=None, node_slots=1, node_budget=4 * MiB,
                         node_dir=str(tmp_path))  # fmt: skip
    with pinned:
        assert any(tmp_path.iterdir())  # the node's files, in the directory given
        other = pinpool.PinnedPool(size=MiB, runtime=FakeRuntime(), registry=None, node_budget=4 * MiB,
                                   node_dir=str(tmp_path), node_wait=False, name="other")  # fmt: skip
        with pytest.raises(NodeBusyError), other:
            pass  # the tensor holds the node's whole byte budget while it is pinned
    again = pinpool.pin(rows(1), runtime=FakeRuntime(), registry=None, node_budget=4 * MiB, node_dir=str(tmp_path),
                        node_wait=False)  # fmt: skip
    with again as p:  # released at exit
        assert p.state is PoolState.READY


def test_pin_retries_and_min_chunk_bytes_apply() -> None:
    fake = FakeRuntime(fail_register_larger_than="2MiB")
    with pinpool.pin(rows(8), runtime=fake, registry=None, chunk_bytes="8MiB", min_chunk_bytes="1MiB",
                     max_retries=4, populate=False) as p:  # fmt: skip
        assert p.stats.retries == 3  # 8 -> 4 + 4 -> 2 + 2 + 4 -> ... each half of <= 2 MiB registers
    with pytest.raises(pinpool.PinError), pinpool.pin(rows(8), runtime=FakeRuntime(fail_register_larger_than="2MiB"),
                                                      registry=None, chunk_bytes="8MiB", max_retries=0):  # fmt: skip
        pass


def test_pin_rejects_the_options_the_tensor_decides() -> None:
    with pytest.raises(TypeError):
        pinpool.pin(rows(1), size="1MiB")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        pinpool.pin(rows(1), huge_pages=True)  # type: ignore[call-arg]
