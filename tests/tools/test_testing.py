"""pinpool.testing's helpers: host_facts, assert_released, locked_bytes."""

from __future__ import annotations

from typing import Any

import pytest

from pinpool._ranges import PINNED_RANGES
from pinpool.testing import assert_released, host_facts, locked_bytes


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
