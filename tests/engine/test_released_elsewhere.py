"""Teardown interop: a registration someone else released first (SGLang's ``destroy()`` and
vLLM's ``cleanup()`` unregister a buffer's base when they hold no record of their own) is
released, not leaked: pinpool records it (a warning event naming the range, a counter),
unregisters every other chunk and lets the memory go."""

from __future__ import annotations

import gc

import pytest
import structlog
from prometheus_client import CollectorRegistry

import pinpool
from pinpool.runtimes import CudaRuntime, RocmRuntime
from pinpool.testing import FakeCudart, FakeRuntime, locked_bytes

from ..conftest import each_driver, mapped, needs_mlock, pin_and_run

MiB = 1 << 20

pytestmark = pytest.mark.anyio


def released_count(registry: CollectorRegistry, runtime: str) -> float:
    value = registry.get_sample_value("pinpool_released_elsewhere_total", {"pool": "kv", "runtime": runtime})
    return 0.0 if value is None else value


@needs_mlock
@each_driver
@pytest.mark.parametrize("peer", ["base", "every_chunk"])
async def test_a_peer_releases_first_then_pinpool_closes_cleanly(mode: str, peer: str, vmlck_baseline: int) -> None:
    fake = FakeCudart()
    registry = CollectorRegistry()
    bases: list[int] = []

    def peer_teardown(entered: pinpool.PinnedPool) -> None:
        bases.extend(sorted(fake.registered))
        assert len(bases) == 4 and bases[0] == entered.data_ptr
        for base in bases if peer == "every_chunk" else bases[:1]:
            assert fake.cudaHostUnregister(base) == 0  # the server's own clean-up, while the pool is open

    with structlog.testing.capture_logs() as logs:  # the pool binds its logger when constructed
        pool = pinpool.PinnedPool(
            size=32 * MiB, chunk_bytes=8 * MiB, runtime=CudaRuntime.from_binding(fake), registry=registry, name="kv"
        )
        await pin_and_run(pool, mode, peer_teardown)  # no UnpinError
    released = [e for e in logs if e["event"] == "chunk.released_elsewhere"]
    expected = bases if peer == "every_chunk" else bases[:1]
    assert sorted(int(e["ptr"], 16) for e in released) == sorted(expected)
    assert all(e["log_level"] == "warning" and e["code"] == 713 and e["nbytes"] == 8 * MiB for e in released)
    assert all(e["reason"] == "cudaErrorHostMemoryNotRegistered" for e in released)
    assert not [e for e in logs if e["event"] == "pool.unpin.failed"]
    assert released_count(registry, "cuda") == len(expected)
    assert fake.registered == {} and fake.cudaGetLastError() == 0  # every 713 was cleared
    unregisters = [(ptr, rc) for op, ptr, _n, rc in fake.calls if op == "unregister"]
    assert sorted(ptr for ptr, rc in unregisters if rc == 0) == bases  # pinpool still unregistered the others
    address = bases[0]
    del pool
    gc.collect()
    assert not mapped(address)  # nothing kept mapped
    assert locked_bytes() == vmlck_baseline


@needs_mlock
@each_driver
async def test_pinpool_closes_first_then_the_peer_finds_nothing(mode: str, vmlck_baseline: int) -> None:
    """The reverse order: pinpool has nothing to do; the peer's own unregister gets 713."""
    fake = FakeCudart()
    registry = CollectorRegistry()
    pool = pinpool.PinnedPool(
        size=16 * MiB, chunk_bytes=8 * MiB, runtime=CudaRuntime.from_binding(fake), registry=registry, name="kv"
    )
    bases: list[int] = []
    await pin_and_run(pool, mode, lambda entered: bases.append(entered.data_ptr))
    assert fake.registered == {}
    assert fake.cudaHostUnregister(bases[0]) == 713  # the server's destroy(), after pinpool's close
    assert fake.cudaGetLastError() == 713  # the peer's failure is the peer's to clear
    assert fake.registered == {} and released_count(registry, "cuda") == 0
    assert locked_bytes() == vmlck_baseline


def test_rocm_declares_its_own_code() -> None:
    fake = FakeCudart(platform="rocm", lock=False)
    runtime = RocmRuntime.from_binding(fake)
    runtime.register(0x10_0000, MiB)
    assert fake.cudaHostUnregister(0x10_0000) == 0
    with pytest.raises(pinpool.RuntimeCallError) as info:
        runtime.unregister(0x10_0000)
    assert info.value.code in RocmRuntime.capabilities.not_registered_codes == frozenset({1062})
    assert CudaRuntime.capabilities.not_registered_codes == frozenset({713})


@needs_mlock
def test_a_real_failure_beside_a_release_still_leaks_that_chunk_only() -> None:
    """713 is never taken for more than it says: another chunk's failed unregister is an UnpinError,
    and the memory stays mapped (part of it may still be pinned)."""
    fake = FakeCudart()
    registry = CollectorRegistry()
    pool = pinpool.PinnedPool(
        size=32 * MiB, chunk_bytes=8 * MiB, runtime=CudaRuntime.from_binding(fake), registry=registry, name="kv"
    )
    with pytest.raises(pinpool.UnpinError, match="1 chunk\\(s\\) failed to unregister") as info:
        with pool:
            bases = sorted(fake.registered)
            assert fake.cudaHostUnregister(bases[0]) == 0
            fake.fail("unregister", 2, when=lambda ptr, _n: ptr == bases[2])
    assert "cudaErrorMemoryAllocation" in str(info.value)
    assert fake.registered == {bases[2]: 8 * MiB} and released_count(registry, "cuda") == 1
    assert mapped(bases[0])  # kept: chunk 2 may still be pinned
    assert fake.cudaHostUnregister(bases[2]) == 0  # unlock it, so the test leaves VmLck as it found it


def test_a_release_during_a_rollback_is_not_a_leak() -> None:
    """A peer releases chunk 0 while a foreground pool is still pinning; chunk 3 fails; the rollback
    unregisters chunks 1 and 2, finds chunk 0 released, and reports no leak."""
    fake = FakeRuntime(fail_register_on=4)
    registry = CollectorRegistry()

    def peer(op: str, ptr: int, _nbytes: int) -> None:
        if op == "register" and len(fake.register_calls) == 3:  # before the 4th call, in the worker
            fake.unregister(min(fake.registered))

    fake.before_call = peer
    pool = pinpool.PinnedPool(
        size=32 * MiB, chunk_bytes=8 * MiB, runtime=fake, registry=registry, name="kv", register_workers=1,
        max_retries=0,
    )  # fmt: skip
    with pytest.raises(pinpool.PinError) as info:
        with pool:
            pass
    assert not info.value.leaked and fake.registered == {}
    assert released_count(registry, "fake") == 1
    assert fake.unregister_calls.count(fake.register_calls[0][0]) == 2  # the peer's, then pinpool's (713)
