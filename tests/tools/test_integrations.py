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
from pinpool import RuntimeCallError
from pinpool.runtimes import CudaRuntime
from pinpool.testing import FakeCudart, FakeRegistrar, locked_bytes

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


class _HiCacheNixl:
    """What the HiCache NIXL drop-in reads of SGLang's HiCacheNixl: its host pool (a page_first kv_buffer
    and its per-page descriptors), its registrations and close()'s fields; the registrar a FakeRegistrar."""

    PAGE = 16 * 4 * 4 * 64 * 2  # one page's K descriptor: page_size * layers * heads * head_dim * bf16

    def __init__(self, registrar: FakeRegistrar, pages: int = 64) -> None:
        kv = pinpool.empty((2, pages * 16, 4, 4, 64), dtype=torch.bfloat16)  # page_first (2, size, L, H, D)
        self.mem_pool_host = SimpleNamespace(
            kv_buffer=kv, page_size=16, get_page_buffer_meta=lambda indices: ([kv.data_ptr()], [self.PAGE])
        )
        self._pinpool_registrar, self._host_regs, self._l3_cleaner = registrar, [], None
        self._bounce_set = self._bounce_get = self._bounce_page_bytes = None
        self._hybrid_pool_ctx: dict[str, object] = {}


def test_sglang_hicache_nixl_registers_whole_pages_and_close_deregisters_before_unpinning() -> None:
    fake, pinned_at_unregister = FakeCudart(), []

    def seen(op: str, ptr: int, nbytes: int) -> None:  # is that range still pinned when the engine lets go?
        if op == "unregister":
            pinned_at_unregister.append(ptr in fake.registered)

    engine = FakeRegistrar("nixl", before_call=seen)
    shim = load("sglang_hicache_nixl", fake)
    shim.MAX_CHUNK_BYTES = 3 * _HiCacheNixl.PAGE + 4096  # not whole pages: cut down to 3 pages
    backend, before = _HiCacheNixl(engine), locked_bytes()
    kv = backend.mem_pool_host.kv_buffer
    shim._pre_register_host(backend, kv.data_ptr(), kv.nbytes, "kv_buffer")
    [pool] = backend._host_regs
    assert sorted(engine.registered.items()) == sorted(fake.registered.items())
    assert sum(engine.registered.values()) == kv.nbytes and len(engine.registered) == 43  # 128 pages: 42 x 3 + 2
    page = _HiCacheNixl.PAGE
    assert all((p - kv.data_ptr()) % page == 0 and n % page == 0 for p, n in engine.registered.items())
    bounce = shim._alloc_registered(backend, 4096, torch.bfloat16, False, "bounce_set")
    assert bounce.shape == (shim.STORAGE_BATCH_SIZE, 4096) and len(backend._host_regs) == 2
    assert sum(engine.registered.values()) == kv.nbytes + bounce.nbytes
    backend._bounce_set = bounce
    shim.close(backend)
    assert engine.registered == {} and fake.registered == {} and locked_bytes() == before and backend._host_regs == []
    assert pool.state is pinpool.PoolState.CLOSED and backend._bounce_set is None
    assert len(pinned_at_unregister) == len(engine.register_calls) and all(pinned_at_unregister)


def test_sglang_hicache_nixl_a_refused_registration_leaves_nothing_registered_or_pinned() -> None:
    fake, engine = FakeCudart(), FakeRegistrar("nixl", fail_register_on=5)
    shim = load("sglang_hicache_nixl", fake)
    shim.MAX_CHUNK_BYTES = 2 * _HiCacheNixl.PAGE
    backend, before = _HiCacheNixl(engine), locked_bytes()
    kv = backend.mem_pool_host.kv_buffer
    with pytest.raises(pinpool.PinError, match="injected failure"):
        shim._pre_register_host(backend, kv.data_ptr(), kv.nbytes, "kv_buffer")
    assert backend._host_regs == [] and engine.registered == {} and fake.registered == {} and locked_bytes() == before
    assert len(engine.register_calls) >= 5  # four registered, the fifth refused, all four undone


class _Store:
    """MooncakeDistributedStore's two calls with its answers: 0, -600 for an address it does not hold,
    and a refusal (rc) for the ``refuse``-th register_buffer."""

    def __init__(self, refuse: int = 0, rc: int = -1) -> None:
        self.held: dict[int, int] = {}
        self.calls, self.refuse, self.rc = 0, refuse, rc

    def register_buffer(self, ptr: int, nbytes: int) -> int:
        self.calls += 1
        if self.calls == self.refuse:
            return self.rc
        self.held[ptr] = nbytes
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return 0 if self.held.pop(ptr, None) is not None else -600


def test_sglang_mooncake_store_registers_whole_pages_and_close_unregisters_everything() -> None:
    fake, before = FakeCudart(), locked_bytes()
    shim = load("sglang_mooncake_store", fake)
    shim.MAX_CHUNK_BYTES = 3 * _HiCacheNixl.PAGE
    backend = _HiCacheNixl(FakeRegistrar())  # the same host pool stand-in; the store is the registrar here
    backend.store, backend._pinpool_registrar = (store := _Store()), None
    kv = backend.mem_pool_host.kv_buffer
    for half in kv.unbind(0):  # as SGLang's MHA: K and V apart
        shim.register_buffer(backend, half)
    assert sum(store.held.values()) == kv.nbytes and len(store.held) == 2 * 22  # 64 pages a half, 3 a registration
    assert sorted(store.held.items()) == sorted(fake.registered.items())
    assert all((p - kv.data_ptr()) % _HiCacheNixl.PAGE == 0 for p in store.held)
    with pytest.raises(RuntimeCallError) as error:
        backend._pinpool_registrar.unregister(kv.data_ptr() + 1, 1, None)
    assert error.value.code in backend._pinpool_registrar.limits.not_registered_codes
    shim.close(backend)
    assert store.held == {} and fake.registered == {} and locked_bytes() == before


def test_sglang_mooncake_store_a_refused_registration_is_typed_and_rolled_back() -> None:
    fake, before = FakeCudart(), locked_bytes()
    shim = load("sglang_mooncake_store", fake)
    shim.MAX_CHUNK_BYTES = 2 * _HiCacheNixl.PAGE
    backend = _HiCacheNixl(FakeRegistrar())
    backend.store, backend._pinpool_registrar = (store := _Store(refuse=4, rc=-1)), None
    with pytest.raises(pinpool.PinError) as error:
        shim.register_buffer(backend, backend.mem_pool_host.kv_buffer)
    assert "MooncakeDistributedStore.register_buffer answered -1" in str(error.value)
    assert store.held == {} and fake.registered == {} and locked_bytes() == before
    assert getattr(backend, "_pinpool_pools", []) == []
