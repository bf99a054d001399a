"""LMCache 0.5.6's own allocators on the drop-ins."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import load_shim

import pinpool

mm = pytest.importorskip("lmcache.v1.memory_management")
from lmcache.v1.memory_allocators.lazy_memory_allocator import LazyMemoryAllocator  # noqa: E402
from lmcache.v1.memory_allocators.pin_memory_allocator import PinMemoryAllocator  # noqa: E402
from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator  # noqa: E402

MiB = 1 << 20


def test_pin_memory_allocator_allocates_frees_and_closes_on_pinpool(fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    shim = load_shim("lmcache_pinned_memory", fake)
    monkeypatch.setattr(mm, "_allocate_cpu_memory", shim._allocate_cpu_memory)
    monkeypatch.setattr(mm, "_free_cpu_memory", shim._free_cpu_memory)
    allocator = PinMemoryAllocator(32 * MiB)
    assert sum(fake.registered.values()) == 32 * MiB
    objs = [allocator.allocate(torch.Size([MiB]), torch.uint8) for _ in range(16)]
    assert all(o is not None for o in objs)
    allocator.batched_free(objs)
    allocator.close()


def test_lazy_subclass_opens_only_pinned_memory_and_a_failing_step_stops_it(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shim = load_shim("lmcache_pinned_memory", fake)
    Lazy = shim.lazy_allocator(LazyMemoryAllocator, TensorMemoryAllocator)
    fake.fail("register", 2, times=100, when=lambda ptr, nbytes: ptr >= fake_base[0] + 128 * MiB)
    fake_base = [0]
    monkeypatch.setattr(Lazy, "PIN_CHUNK_SIZE", 64 * MiB)
    fake_base[0] = 1 << 62  # set for real below, once the arena's address is known
    allocator = Lazy(64 * MiB, 256 * MiB)
    fake_base[0] = allocator._buffer.data_ptr()
    allocator._expand_thread.join(timeout=60)
    objs = [o for o in (allocator.allocate(torch.Size([MiB]), torch.uint8) for _ in range(256)) if o is not None]
    pinned = allocator._pool.pinned_pages
    assert objs and all(o.tensor.data_ptr() + MiB <= allocator._buffer.data_ptr() + pinned for o in objs)
    allocator.batched_free(objs)
    allocator.close()
    assert allocator._pool.state == pinpool.PoolState.CLOSED
