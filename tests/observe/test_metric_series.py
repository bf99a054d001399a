"""Metric series stay bounded: a closed pool's gauge series go with it (issue 12, item 6).

Every distinct ``name=`` used to leave its labelled series behind for good (1,000 pool names:
112k samples). Now the gauges of a ``(pool, runtime)`` label pair are removed when the last
open pool holding them closes; counters and histograms are cumulative and stay. Two open
pools with the same name share their series, so the first to close removes nothing.
"""

from __future__ import annotations

import gc
import resource
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import pinpool
from pinpool._ranges import PINNED_RANGES
from pinpool.metrics import PoolMetrics, metrics_for
from pinpool.runtimes import CudaRuntime
from pinpool.testing import FakeCudart, FakeRuntime

KiB = 1 << 10
MiB = 1 << 20

GAUGES = {
    "pinpool_pinned_bytes", "pinpool_pool_bytes", "pinpool_chunks_in_flight", "pinpool_pools_open",
    "pinpool_pools_ready", "pinpool_call_seconds_max", "pinpool_pool_info", "pinpool_transfer_registrations",
    "pinpool_transfer_registered_bytes", "pinpool_reserved_bytes", "pinpool_memory_pressure_psi",
}  # fmt: skip


def samples(registry: CollectorRegistry, kind: str | None = None) -> Iterator[Any]:
    for family in registry.collect():
        if kind is None or family.type == kind:
            yield from family.samples


def gauge_count(registry: CollectorRegistry) -> int:
    return sum(1 for _ in samples(registry, "gauge"))


def gauges_of(registry: CollectorRegistry, pool: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The gauge samples labelled ``pool=pool``: (name, other labels) -> value."""
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("pool", "runtime")))): s.value
        for s in samples(registry, "gauge")
        if s.labels.get("pool") == pool
    }


def gauge(registry: CollectorRegistry, name: str, pool: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"pool": pool, "runtime": "fake", **labels})


def test_the_gauges_are_the_families_pinpool_removes() -> None:
    registry = CollectorRegistry()
    metrics_for(registry)
    assert {family.name for family in registry.collect() if family.type == "gauge"} == GAUGES


# Pool names opened and closed one after another. Whether a closed pool's gauges go is exact at
# any count: 200 (it was 1,000, ~15 s) prove what 1,000 did. docs/metrics.md quotes the figures
# this test prints for 1,000 (set NAMES = 1000 and run it with -s to measure them again).
NAMES = 200


def test_many_pool_names_leave_no_gauge_series() -> None:
    registry = CollectorRegistry()
    # A long-lived pool keeps its series throughout: only the closed pools' series go.
    with pinpool.PinnedPool(size=256 * KiB, runtime=FakeRuntime(), name="kv-host", registry=registry) as keeper:
        before = gauge_count(registry)
        kept = gauges_of(registry, "kv-host")
        assert before > 0 and kept[("pinpool_pinned_bytes", ())] == keeper.nbytes
        total_before = sum(1 for _ in samples(registry))
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for i in range(NAMES):
            with pinpool.PinnedPool(size=64 * KiB, runtime=FakeRuntime(), name=f"pool-{i}", registry=registry) as p:
                if i == 0:
                    assert gauge_count(registry) > before  # it had series while open
                    assert gauge(registry, "pinpool_pools_open", "pool-0") == 1
                    assert gauge(registry, "pinpool_pinned_bytes", "pool-0") == p.nbytes
        gc.collect()
        after = gauge_count(registry)
        total_after = sum(1 for _ in samples(registry))
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert after == before
        assert gauges_of(registry, "kv-host") == kept
        assert gauges_of(registry, f"pool-{NAMES - 1}") == {}
        # Counters and histograms are cumulative: they stay (see docs/metrics.md, "Label cardinality").
        last = {"pool": f"pool-{NAMES - 1}", "runtime": "fake"}
        assert registry.get_sample_value("pinpool_registered_bytes_total", last) == 64 * KiB
        assert registry.get_sample_value("pinpool_pool_pin_seconds_count", {"pool": "pool-0", "runtime": "fake"}) == 1
    print(
        f"\n{NAMES:,} pool names: gauge samples {before} -> {after}; all samples {total_before} -> {total_after} "
        f"(counters and histograms); peak RSS +{(rss_after - rss_before) / 1024:.1f} MiB"
    )


def test_two_open_pools_with_one_name_share_their_series_until_both_close() -> None:
    registry = CollectorRegistry()
    a = pinpool.PinnedPool(size=MiB, chunk_bytes=256 * KiB, runtime=FakeRuntime(), name="kv", registry=registry)
    b = pinpool.PinnedPool(size=2 * MiB, chunk_bytes=256 * KiB, runtime=FakeRuntime(), name="kv", registry=registry)
    info = {"layout": "raw", "granularity_bytes": "0", "chunk_bytes": str(256 * KiB)}
    a.__enter__()
    b.__enter__()
    try:
        assert gauge(registry, "pinpool_pools_open", "kv") == 2
        assert gauge(registry, "pinpool_pools_ready", "kv") == 2
        assert gauge(registry, "pinpool_pool_bytes", "kv") == 3 * MiB
        assert gauge(registry, "pinpool_pinned_bytes", "kv") == 3 * MiB
        assert gauge(registry, "pinpool_pool_info", "kv", **info) == 2
        a.__exit__(None, None, None)  # the first to close: b still holds the series
        assert gauge(registry, "pinpool_pools_open", "kv") == 1
        assert gauge(registry, "pinpool_pools_ready", "kv") == 1
        assert gauge(registry, "pinpool_pool_bytes", "kv") == 2 * MiB
        assert gauge(registry, "pinpool_pinned_bytes", "kv") == 2 * MiB
        assert gauge(registry, "pinpool_chunks_in_flight", "kv") == 0
        assert gauge(registry, "pinpool_pool_info", "kv", **info) == 1
        assert gauge(registry, "pinpool_call_seconds_max", "kv", op="register") is not None
    finally:
        b.__exit__(None, None, None)
    assert gauges_of(registry, "kv") == {}
    # The name can be used again: its series start afresh.
    with pinpool.PinnedPool(size=MiB, runtime=FakeRuntime(), name="kv", registry=registry):
        assert gauge(registry, "pinpool_pools_open", "kv") == 1
        assert gauge(registry, "pinpool_pinned_bytes", "kv") == MiB
    assert gauges_of(registry, "kv") == {}


def test_pool_info_goes_with_the_last_pool_of_its_configuration() -> None:
    registry = CollectorRegistry()
    small = pinpool.PinnedPool(size=MiB, chunk_bytes=256 * KiB, runtime=FakeRuntime(), name="kv", registry=registry)
    large = pinpool.PinnedPool(size=MiB, chunk_bytes=512 * KiB, runtime=FakeRuntime(), name="kv", registry=registry)
    with large:
        with small:
            assert gauge(registry, "pinpool_pool_info", "kv", layout="raw", granularity_bytes="0",
                         chunk_bytes=str(256 * KiB)) == 1  # fmt: skip
        # small's configuration is gone; large's stays while large is open.
        assert [key for key in gauges_of(registry, "kv") if key[0] == "pinpool_pool_info"] == [
            ("pinpool_pool_info", (("chunk_bytes", str(512 * KiB)), ("granularity_bytes", "0"), ("layout", "raw")))
        ]
        assert gauge(registry, "pinpool_pools_open", "kv") == 1
    assert gauges_of(registry, "kv") == {}


class OtherFake(FakeRuntime):
    name = "other"


def test_a_runtime_is_part_of_the_series_key(fake: FakeRuntime) -> None:
    registry = CollectorRegistry()
    with pinpool.PinnedPool(size=MiB, runtime=OtherFake(), name="kv", registry=registry) as other:
        with pinpool.PinnedPool(size=MiB, runtime=fake, name="kv", registry=registry):
            assert gauge(registry, "pinpool_pools_open", "kv") == 1
        assert gauge(registry, "pinpool_pools_open", "kv") is None  # the fake's series are gone
        assert registry.get_sample_value("pinpool_pools_open", {"pool": "kv", "runtime": "other"}) == 1
        assert registry.get_sample_value("pinpool_pinned_bytes", {"pool": "kv", "runtime": "other"}) == other.nbytes
    assert gauges_of(registry, "kv") == {}


def test_leaked_bytes_keep_their_pinned_bytes_series() -> None:
    registry = CollectorRegistry()
    with (
        pytest.raises(pinpool.UnpinError),
        pinpool.PinnedPool(
            size=2 * MiB, chunk_bytes=MiB, runtime=FakeRuntime(fail_unregister_on=1), name="leaky", registry=registry,
            register_workers=1, unpin_workers=1,
        ),
    ):  # fmt: skip
        pass
    # The chunk that failed to unregister may still be pinned: that is what the gauge says.
    assert gauges_of(registry, "leaky") == {("pinpool_pinned_bytes", ()): MiB}
    with pinpool.PinnedPool(size=MiB, runtime=FakeRuntime(), name="leaky", registry=registry):
        assert gauge(registry, "pinpool_pinned_bytes", "leaky") == 2 * MiB
    assert gauges_of(registry, "leaky") == {("pinpool_pinned_bytes", ()): MiB}


def test_a_rolled_back_pool_removes_its_series() -> None:
    registry = CollectorRegistry()
    with (
        pytest.raises(pinpool.PinError),
        pinpool.PinnedPool(
            size=4 * MiB, chunk_bytes=MiB, runtime=FakeRuntime(fail_register_on=2), name="failing",
            registry=registry, register_workers=1, max_retries=0,
        ),
    ):  # fmt: skip
        pytest.fail("the body must not run")
    assert gauges_of(registry, "failing") == {}
    assert registry.get_sample_value("pinpool_rollbacks_total", {"pool": "failing", "runtime": "fake",
                                                                 "cause": "failure"}) == 1  # fmt: skip


@pytest.mark.anyio
async def test_a_failed_background_pool_keeps_its_series_until_exit() -> None:
    registry = CollectorRegistry()
    fake = FakeRuntime(fail_register_on=3, register_delay=0.001)
    async with pinpool.PinnedPool(
        size=8 * MiB, chunk_bytes=MiB, runtime=fake, name="bg", registry=registry, background=True,
        register_workers=1, max_retries=0,
    ) as pool:  # fmt: skip
        with pytest.raises(pinpool.PinError):
            await pool.wait_ready()
        # Failed, and still open: what it pinned stays pinned (and counted) until exit.
        assert gauge(registry, "pinpool_pools_open", "bg") == 1
        assert gauge(registry, "pinpool_pinned_bytes", "bg") == 2 * MiB
    assert gauges_of(registry, "bg") == {}


def test_the_finalizer_removes_an_unexited_pools_series(fake: FakeRuntime) -> None:
    registry = CollectorRegistry()
    pool = pinpool.PinnedPool(size=MiB, runtime=fake, name="forgotten", registry=registry)
    pool.__enter__()
    assert gauge(registry, "pinpool_pools_open", "forgotten") == 1
    with pytest.warns(pinpool.UnclosedPoolWarning):
        del pool
        gc.collect()
    assert gauges_of(registry, "forgotten") == {}


def test_multiprocess_mode_keeps_the_series(fake: FakeRuntime, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    # prometheus_client cannot remove a series in multiprocess mode (it only warns, and the
    # value stays in the process's file): pinpool leaves them, at 0, and warns nothing.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    registry = CollectorRegistry()
    with pinpool.PinnedPool(size=MiB, runtime=fake, name="mp", registry=registry):
        pass
    assert gauge(registry, "pinpool_pools_open", "mp") == 0
    assert gauge(registry, "pinpool_pinned_bytes", "mp") == 0


def test_series_are_never_removed_under_an_open_pool() -> None:
    """Threads open and close pools of one name at once: while a thread holds the series, its
    increments are in the registry (a namesake's removal never orphans them)."""
    registry = CollectorRegistry()
    metrics = PoolMetrics(registry)
    labels, info = ("hot", "fake"), ("hot", "fake", "raw", "0", "1")
    errors: list[str] = []

    def worker() -> None:
        for _ in range(300):
            metrics.pool_opened(labels, info)
            metrics.pools_open.labels(*labels).inc()
            metrics.pool_info.labels(*info).inc()
            seen = registry.get_sample_value("pinpool_pools_open", {"pool": "hot", "runtime": "fake"})
            if seen is None or seen < 1:
                errors.append(f"an open pool saw pools_open={seen}")
            metrics.pool_info.labels(*info).dec()
            metrics.pools_open.labels(*labels).dec()
            metrics.pool_closed(labels, info)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert gauge_count(registry) == 0


def test_pools_of_one_name_on_many_threads_end_with_no_series() -> None:
    registry = CollectorRegistry()
    failures: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(15):
                size = (n + i % 3 + 1) * 64 * KiB
                with pinpool.PinnedPool(size=size, runtime=FakeRuntime(), name="shared", registry=registry) as p:
                    opened = gauge(registry, "pinpool_pools_open", "shared")
                    assert opened is not None and opened >= 1
                    pinned = gauge(registry, "pinpool_pinned_bytes", "shared")
                    assert pinned is not None and pinned >= p.nbytes
        except BaseException as exc:  # reported below, on the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert gauges_of(registry, "shared") == {}
    assert registry.get_sample_value("pinpool_pool_pin_seconds_count", {"pool": "shared", "runtime": "fake"}) == 90


@pytest.mark.anyio
async def test_async_pools_remove_their_series_too() -> None:
    registry = CollectorRegistry()
    async with pinpool.PinnedPool(size=MiB, runtime=FakeRuntime(), name="a", registry=registry):
        async with pinpool.PinnedPool(size=MiB, runtime=FakeRuntime(), name="a", registry=registry):
            assert gauge(registry, "pinpool_pools_open", "a") == 2
        assert gauge(registry, "pinpool_pools_open", "a") == 1
    assert gauges_of(registry, "a") == {}


def failure_reasons(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (s.labels["phase"], s.labels["reason"]): s.value
        for s in samples(registry)
        if s.name == "pinpool_chunk_failures_total"
    }


def test_garbage_codes_add_no_reason_series(claims_back: None) -> None:
    """Issue 33, item 10: the reason label took the runtime's code name (or an exception's class name),
    so a binding answering garbage codes added one series per code. Documented names plus "other"."""
    fake = FakeCudart(lock=False)
    registry = CollectorRegistry()
    for rc in range(5000, 5100):  # 100 distinct codes no library knows: cudaError5000, ...
        fake.fail("unregister", rc)
    pool = pinpool.PinnedPool(
        size=100 * MiB, chunk_bytes=MiB, runtime=CudaRuntime.from_binding(fake), registry=registry, name="garbage",
        populate=False, unpin_workers=1,
    )  # fmt: skip
    with pytest.raises(pinpool.UnpinError) as info:
        with pool:
            pass
    assert {failure.error.reason for failure in info.value.failures} == {f"cudaError{rc}" for rc in range(5000, 5100)}
    assert failure_reasons(registry) == {("unregister", "other"): 100}
    fake.fail("register", 2, when=lambda _p, nbytes: nbytes == MiB)  # a documented name keeps its own series
    fake.fail("register", 5000)
    for _ in range(2):
        with pytest.raises(pinpool.PinError):
            with pinpool.PinnedPool(
                size=2 * MiB, chunk_bytes=MiB, runtime=CudaRuntime.from_binding(fake), registry=registry,
                name="garbage", populate=False, max_retries=0,
            ):  # fmt: skip
                pass
    assert set(failure_reasons(registry)) == {
        ("unregister", "other"), ("register", "cudaErrorMemoryAllocation"), ("register", "other")
    }  # fmt: skip
    for base in list(fake.registered):  # the 100 chunks reported leaked, released by hand
        assert fake.cudaHostUnregister(base) == 0


@pytest.fixture
def claims_back() -> Iterator[None]:
    before = PINNED_RANGES.snapshot()
    yield
    for base in PINNED_RANGES.snapshot().keys() - before.keys():
        PINNED_RANGES.pop(base)
