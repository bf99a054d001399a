"""examples/integrations/: the drop-ins for SGLang, vLLM and LMCache, on plain tensors and
mappings, with pinpool's real CUDA runtime on ``pinpool.testing.FakeCudart`` (which keeps CUDA's
registration books and really mlocks). ``./dev peers`` runs them inside the released classes."""

from __future__ import annotations

import importlib.util
import mmap
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

import pinpool
from pinpool.runtimes import CudaRuntime
from pinpool.testing import FakeCudart, locked_bytes

from ..conftest import needs_mlock

pytestmark = needs_mlock
INTEGRATIONS = Path(__file__).resolve().parents[2] / "examples" / "integrations"
MiB = 1 << 20


def load(name: str, fake: FakeCudart) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"pinpool_integration_{name}", INTEGRATIONS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.RUNTIME = CudaRuntime.from_binding(fake)  # type: ignore[attr-defined]
    return module


def test_sglang_shim_records_pinpools_ranges_and_their_unregister_then_pinpools_close_leak_nothing() -> None:
    fake = FakeCudart()
    shim = load("sglang_host_register", fake)
    g = 16 * 4 * 4 * 64 * 2  # page_size * layout_dim, as SGLang passes it for page_first
    buffer = pinpool.empty((2, 64, 4, 4, 64), dtype=torch.bfloat16)
    before = locked_bytes()
    shim._cuda_host_register(buffer, g)
    ranges = buffer._sglang_cuda_host_registered_ranges
    assert sorted(fake.registered.items()) == sorted(ranges) and sum(n for _, n in ranges) == buffer.nbytes
    for ptr, _ in reversed(ranges):  # what SGLang's own _cuda_host_unregister does in destroy()
        assert fake.cudaHostUnregister(ptr) == 0
    shim._cuda_host_unregister(buffer)  # pinpool's close: 713 is "released elsewhere", not an error
    assert fake.registered == {} and locked_bytes() == before and buffer._pinpool_pool.state == pinpool.PoolState.CLOSED


def test_sglang_alloc_with_host_register_has_their_dims_and_one_call_without_a_granularity() -> None:
    fake = FakeCudart()
    shim = load("sglang_host_register", fake)
    dims = (2, 4, 64, 4, 64)  # layer_first: SGLang registers it in one call
    buffer = shim.alloc_with_host_register(dims, torch.bfloat16, "cpu", True, None, None)
    assert tuple(buffer.shape) == dims and buffer.is_contiguous()
    assert list(fake.registered.values()) == [buffer.nbytes] and shim.host_pool_ready(buffer)
    shim._cuda_host_unregister(buffer)
    assert fake.registered == {}


def test_sglang_gate_refuses_slots_until_the_background_pool_is_ready() -> None:
    fake = FakeCudart()
    shim = load("sglang_host_register", fake)
    shim.BACKGROUND = True
    fake.fail("register", 2, times=1)  # the background pinning fails: the gate must raise, not hand out

    class Base:
        def alloc(self, need_size: int) -> list[int]:
            return list(range(need_size))

    class Host(shim.GatedAlloc, Base):  # type: ignore[name-defined,misc]
        pass

    host = Host()
    host.kv_buffer = shim.alloc_with_host_register((2, 8, 4, 64), torch.bfloat16, "cpu", True, None, None)
    pool = host.kv_buffer._pinpool_pool
    with pytest.raises(pinpool.PinError):
        pool.wait_ready_sync(timeout=30)
    with pytest.raises(pinpool.PinError):
        host.alloc(16)
    shim._cuda_host_unregister(host.kv_buffer)


@pytest.mark.parametrize("worker_slot_only", [False, True], ids=["whole-rows", "worker-slots"])
def test_vllm_pin_mmap_region_both_modes_and_the_recipes_order(worker_slot_only: bool) -> None:
    fake = FakeCudart()
    shim = load("vllm_pin_mmap_region", fake)
    rows, workers, slot = 8, 4, MiB  # a row is 4 slots; one worker's slot saves 3 MiB a row
    mm = mmap.mmap(-1, rows * workers * slot)
    region = SimpleNamespace(
        _row_stride=workers * slot, cpu_page_size=slot, page_size=mmap.PAGESIZE, rank=1,
        _base=torch.frombuffer(memoryview(mm), dtype=torch.int8), pinned_addresses=[], is_pinned=False,
    )  # fmt: skip
    region.iter_worker_slot_ranges = lambda: ((r * workers * slot + slot, slot) for r in range(rows))
    before = locked_bytes()
    shim.pin_mmap_region(region, worker_slot_only=worker_slot_only)
    assert region.is_pinned and sorted(region.pinned_addresses) == sorted(fake.registered)
    expected = rows * slot if worker_slot_only else rows * workers * slot
    assert sum(fake.registered.values()) == expected
    if worker_slot_only:
        assert len(fake.registered) == rows
    shim.unpin_mmap_region(region)
    assert not region.is_pinned and region.pinned_addresses == [] and fake.registered == {} and locked_bytes() == before
    region._base = None
    mm.close()  # pinpool no longer holds the mapping's buffer


def test_lmcache_allocate_cpu_memory_pins_and_a_failing_pin_hands_out_nothing() -> None:
    fake = FakeCudart()
    shim = load("lmcache_pinned_memory", fake)
    before = locked_bytes()
    arena = shim._allocate_cpu_memory(8 * MiB)
    assert arena.dtype == torch.uint8 and arena.numel() == 8 * MiB and sum(fake.registered.values()) == 8 * MiB
    shim._free_cpu_memory(arena, 8 * MiB)
    assert fake.registered == {} and locked_bytes() == before
    fake.fail("register", 2, times=100)
    with pytest.raises(pinpool.PinError):
        shim._allocate_cpu_memory(8 * MiB)
    assert fake.registered == {} and shim._POOLS == {} and locked_bytes() == before
