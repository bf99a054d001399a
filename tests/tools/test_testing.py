"""pinpool.testing's helpers: host_facts, assert_released, locked_bytes, auto_runtime."""

from __future__ import annotations

from typing import Any

import pytest

import pinpool
from pinpool._ranges import PINNED_RANGES
from pinpool.testing import FakeRuntime, assert_released, auto_runtime, host_facts, locked_bytes


def test_host_facts_is_a_healthy_host_with_changes() -> None:
    host = host_facts(cpus=2, numa_nodes=(0, 1))
    assert (host.cpus, host.numa_nodes, host.cap_ipc_lock, host.memlock_soft) == (2, (0, 1), True, None)
    assert host_facts() == host_facts() and host_facts().cpus == 8
    with pytest.raises(TypeError):
        host_facts(no_such_field=1)


def test_assert_released_passes_a_closed_pool_and_names_what_was_left(pinned_pool_factory: Any) -> None:
    fake = pinned_pool_factory.fake_runtime
    pool = pinned_pool_factory(size="2MiB", chunk_bytes="1MiB", name="released")
    with pytest.raises(AssertionError, match="is new"):
        assert_released(pool)
    with pool:
        with pytest.raises(AssertionError, match="is ready"):
            assert_released(pool)
    assert_released(pool, fake, claims_before=PINNED_RANGES.snapshot(), locked_before=locked_bytes())
    fake.register(0x1000, 4096)
    with pytest.raises(AssertionError, match="still registered"):
        assert_released(pool, fake)
    fake.unregister(0x1000)


def test_locked_bytes_reads_vmlck() -> None:
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmLck:"))
    assert locked_bytes() == kib * 1024


def test_auto_runtime_is_what_auto_means_for_budgets_too() -> None:
    """host_budget() judges "auto" without building it: under auto_runtime, by the stand-in's declaration."""
    host = host_facts(memlock_soft=1 << 20, memlock_hard=1 << 20, cap_ipc_lock=False)  # mlock: 1 MiB at most
    assert pinpool.host_budget(0.5, reserve=0, host=host) <= 1 << 20
    fake = FakeRuntime()
    with auto_runtime(fake) as given:
        assert given is fake
        assert pinpool.host_budget(0.5, reserve=0, host=host) > 1 << 30  # a fake charges nothing to RLIMIT_MEMLOCK
        assert pinpool.PinnedPool(size=1 << 20, registry=None).runtime is fake
    assert pinpool.host_budget(0.5, reserve=0, host=host) <= 1 << 20


def test_auto_runtime_takes_only_a_runtime() -> None:
    with pytest.raises(pinpool.ConfigError, match="is neither a runtime name"), auto_runtime(object()):  # type: ignore[arg-type]
        pass
    assert not isinstance(pinpool.runtimes.resolve_runtime("auto"), FakeRuntime)  # nothing was left in place
