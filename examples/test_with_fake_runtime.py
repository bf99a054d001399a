"""Test your own code's failure paths with ``pinpool.testing.FakeRuntime`` and pinpool's pytest plugin.

    pytest examples/test_with_fake_runtime.py                           # pinpool installed: the plugin is on
    pytest -p pinpool.pytest_plugin examples/test_with_fake_runtime.py  # from a checkout that is not installed

The code under test is ``HostKVPool`` from ``sync_init.py`` (next to this file): a server's
host pool that pins in ``__init__`` and unpins in ``close()``. The fake registers nothing
for real, so these tests need no GPU and no locked memory; it fails on request and keeps the
books CUDA would keep, so a test can check that nothing is left registered.

From the plugin: ``fake_runtime`` (a fresh fake; the test errors at teardown if it still holds
a registration), ``pinned_pool_factory`` (pools on that fake, each checked at teardown to be
exited) and the ``gpu`` marker (skipped without CUDA). See docs/testing.md.
"""

from __future__ import annotations

import anyio
import pytest
from sync_init import HostKVPool

import pinpool
from pinpool.pytest_plugin import PinnedPoolFactory
from pinpool.testing import FakeRuntime

MiB = 1 << 20


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every ``@pytest.mark.anyio`` test under asyncio and under trio (anyio's pytest plugin)."""
    return str(request.param)


def test_pins_on_init_and_unpins_on_close(fake_runtime: FakeRuntime) -> None:
    with HostKVPool(size=8 * MiB, chunk_bytes="1MiB", runtime=fake_runtime, registry=None) as host:
        assert sum(fake_runtime.registered.values()) == host.pool.nbytes  # the fake's books: all of it
        k, v = host.page(0)
        k.fill_(1.0)  # the memory is real, only the registration is fake
        v.copy_(k)
    assert fake_runtime.registered == {}
    assert sorted(fake_runtime.unregister_calls) == sorted(ptr for ptr, _ in fake_runtime.register_calls)


def test_registration_failure_in_init_leaves_nothing_pinned() -> None:
    # Your own fake, configured: the third registration call fails. max_retries=0: its code (2,
    # as CUDA's out of memory) is retryable, and the failed chunk would be retried as halves.
    fake = FakeRuntime(fail_register_on=3)
    with pytest.raises(pinpool.PinError) as info:
        HostKVPool(size=8 * MiB, chunk_bytes="1MiB", runtime=fake, registry=None, max_retries=0)
    assert (info.value.phase, info.value.code, info.value.reason) == ("register", 2, "cudaErrorMemoryAllocation")
    assert fake.registered == {}  # what did register was rolled back
    assert len(fake.unregister_calls) == len(fake.register_calls) - 1  # every success undone, the failure not


def test_failure_after_pinning_unpins_before_init_raises(fake_runtime: FakeRuntime) -> None:
    def register_with_transfer_engine(pool: pinpool.PinnedPool) -> None:
        raise ConnectionError("transfer engine is down")

    with pytest.raises(ConnectionError):
        HostKVPool(size=8 * MiB, runtime=fake_runtime, registry=None, on_pinned=register_with_transfer_engine)
    assert fake_runtime.register_calls  # it was pinned...
    assert fake_runtime.registered == {}  # ...and unpinned before the exception left __init__


def test_unpin_failure_at_close_is_reported(fake_runtime: FakeRuntime) -> None:
    host = HostKVPool(size=8 * MiB, chunk_bytes="4MiB", runtime=fake_runtime, registry=None)
    fake_runtime.fail_next(1, op="unregister")  # the next unregister call fails, whichever chunk it is
    with pytest.raises(pinpool.UnpinError) as info:
        host.close()
    (leaked,) = info.value.leaked  # one chunk may still be pinned; the other was unregistered
    assert leaked.nbytes == 4 * MiB
    assert sum(fake_runtime.registered.values()) == 4 * MiB  # as CUDA would, the fake still holds it
    host.close()  # closing again does nothing
    # This test made unregister fail on purpose: undo the leftover, or fake_runtime's teardown check fails.
    for base in list(fake_runtime.registered):
        fake_runtime.unregister(base)


@pytest.mark.anyio
async def test_deadline_while_pinning_rolls_back_and_skips_the_body(pinned_pool_factory: PinnedPoolFactory) -> None:
    slow = FakeRuntime(register_delay=0.01)  # 10 ms a registration: 64 chunks take far longer than the deadline
    pool = pinned_pool_factory(size=64 * MiB, chunk_bytes="1MiB", runtime=slow)
    with anyio.move_on_after(0.05) as deadline:
        async with pool:
            pytest.fail("the body must not run once the deadline fired")
    assert deadline.cancelled_caught
    assert slow.registered == {} and slow.register_calls  # some chunks registered, all rolled back
    rollbacks = pinned_pool_factory.registry.get_sample_value(
        "pinpool_rollbacks_total", {"pool": pool.name, "runtime": "fake", "cause": "cancelled"}
    )
    assert rollbacks == 1.0  # each test's pools report to a registry of its own


@pytest.mark.anyio
async def test_an_error_in_the_body_unpins_and_propagates(
    pinned_pool_factory: PinnedPoolFactory, fake_runtime: FakeRuntime
) -> None:
    with pytest.raises(KeyError):
        async with pinned_pool_factory(size=4 * MiB, chunk_bytes="1MiB") as pool:  # on fake_runtime
            assert len(fake_runtime.registered) == len(pool.plan.chunks) == 4
            raise KeyError("request 17 failed")
    assert fake_runtime.registered == {}


@pytest.mark.gpu
def test_cuda_round_trip(pinned_pool_factory: PinnedPoolFactory) -> None:
    import torch

    with pinned_pool_factory(size=16 * MiB, runtime="cuda") as pool:  # a real runtime: no fake involved
        assert pool.tensor.is_pinned()
        pool.tensor.fill_(3)
        on_gpu = pool.tensor.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert int(on_gpu[:1024].sum()) == 3 * 1024
