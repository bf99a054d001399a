"""LMCache 0.5.6's own allocators on the drop-ins."""

from __future__ import annotations

import gc
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import load_shim

import pinpool

mm = pytest.importorskip("lmcache.v1.memory_management")
from lmcache.v1.memory_allocators import lazy_memory_allocator as lazy_module  # noqa: E402
from lmcache.v1.memory_allocators.lazy_memory_allocator import LazyMemoryAllocator  # noqa: E402
from lmcache.v1.memory_allocators.pin_memory_allocator import PinMemoryAllocator  # noqa: E402
from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator  # noqa: E402
from lmcache.v1.platform.devices.cuda.pin_memory import CudaPinMemoryBackend  # noqa: E402

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


def _fail_one_step(fake: Any, step: int) -> None:
    """Every registration touching the arena's third step [2*step, 3*step) fails (rc=2); the
    arena's base is the first address registered (both allocators register offset 0 first)."""
    base: list[int] = []

    def third_step(ptr: int, nbytes: int) -> bool:
        base.append(ptr) if not base else None
        return ptr < base[0] + 3 * step and ptr + nbytes > base[0] + 2 * step

    fake.fail("register", 2, times=1000, when=third_step)


def _unpinned(fake: Any, objs: list[Any]) -> int:
    """Objects with a byte outside every registered range (adjacent registrations merged)."""
    covered: list[list[int]] = []
    for ptr, nbytes in sorted(fake.registered.items()):
        if covered and covered[-1][1] == ptr:
            covered[-1][1] = ptr + nbytes
        else:
            covered.append([ptr, ptr + nbytes])
    start = [o.tensor.data_ptr() for o in objs]
    return sum(not any(lo <= p and p + MiB <= hi for lo, hi in covered) for p in start)


@pytest.mark.parametrize("allocator", ["lmcache", "pinpool"])
def test_a_failing_pin_step_lazy_theirs_hands_out_unpinned_memory_pinpools_none(
    fake: Any, monkeypatch: pytest.MonkeyPatch, allocator: str
) -> None:
    """LMCache's own LazyMemoryAllocator (their CUDA pin backend on torch.cuda.cudart(), i.e.
    the FakeCudart) against the drop-in subclass, one 64 MiB step of a 256 MiB arena failing."""
    step = LazyMemoryAllocator.PIN_CHUNK_SIZE
    assert step == 64 * MiB
    if allocator == "lmcache":
        backend = CudaPinMemoryBackend()
        spec = SimpleNamespace(pin_memory=backend.pin_memory, unpin_memory=backend.unpin_memory, is_pin_supported=True)
        monkeypatch.setattr(lazy_module, "current_device_spec", spec)
        cls: Any = LazyMemoryAllocator
    else:
        cls = load_shim("lmcache_pinned_memory", fake).lazy_allocator(LazyMemoryAllocator, TensorMemoryAllocator)
    _fail_one_step(fake, step)
    lazy = cls(step, 4 * step)
    lazy._expand_thread.join(timeout=60)
    assert not lazy._expand_thread.is_alive()
    objs = [o for o in (lazy.allocate(torch.Size([MiB]), torch.uint8) for _ in range(256)) if o is not None]
    unpinned = _unpinned(fake, objs)
    if allocator == "lmcache":  # the failed step is logged, skipped, and its memory handed out
        assert (len(objs), unpinned) == (256, 64)
    else:  # the gate stops at the pinned prefix: two steps, nothing unpinned
        assert (len(objs), unpinned) == (128, 0)
        assert lazy._pool.state == pinpool.PoolState.FAILED
    lazy.batched_free(objs)
    lazy.close()
    objs.clear()
    gc.collect()  # their MemoryObj.__del__ logs while the test's streams are still open
