"""vLLM 0.34.0's own SharedOffloadRegion pinned through the drop-in ``pin_mmap_region``.

vLLM registers through ``host_register`` / ``host_unregister`` on its ``CudaRTLibrary`` (ctypes,
no flags argument) and only where ``current_platform.is_cuda_alike()``: both are answered here
by the same ``FakeCudart`` pinpool's runtime uses, so ``cleanup()``'s own unregistering shares
CUDA's books with pinpool. Both modes (whole rows; this worker's slot of each row), against the
ranges vLLM's own ``pin_mmap_region`` registers, and ``cleanup()`` in both orders."""

from __future__ import annotations

import gc
import itertools
import os
from typing import Any

import pytest
import torch
from conftest import load_shim

import pinpool

gpu_worker = pytest.importorskip("vllm.v1.kv_offload.cpu.gpu_worker")
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.kv_offload.cpu import host_register  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402

MiB = 1 << 20
ROWS, WORKERS, SLOT = 16, 4, MiB  # a row holds 4 workers' 1 MiB slots: one slot saves 3 MiB a row
_ids = itertools.count()


class _CudaRTLibrary:
    """vLLM's CudaRTLibrary's calls (no flags argument) on the shared FakeCudart."""

    def __init__(self, fake: Any) -> None:
        self.fake = fake

    def cudaHostRegister(self, ptr: int, nbytes: int) -> int:
        return int(self.fake.cudaHostRegister(ptr, nbytes, 0))

    def cudaHostUnregister(self, ptr: int) -> int:
        return int(self.fake.cudaHostUnregister(ptr))

    def cudaGetLastError(self) -> int:
        return int(self.fake.cudaGetLastError())


@pytest.fixture
def cuda_host(fake: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(host_register, "_get_cudart", lambda: _CudaRTLibrary(fake))
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    return fake


def _region(rank: int) -> SharedOffloadRegion:
    region = SharedOffloadRegion(f"pinpool-peers-{os.getpid()}-{next(_ids)}", ROWS, rank, WORKERS * SLOT, SLOT)
    region.base_tensor.copy_(torch.arange(region.total_size_bytes, dtype=torch.int64).to(torch.int8))
    return region


def _intact(region: SharedOffloadRegion) -> bool:
    return torch.equal(region.base_tensor, torch.arange(region.total_size_bytes, dtype=torch.int64).to(torch.int8))


def _theirs(fake: Any, worker_slot_only: bool) -> list[tuple[int, int]]:
    """What vLLM's own pin_mmap_region registers, as (offset, nbytes) from the region's base."""
    region = _region(rank=1)
    gpu_worker.pin_mmap_region(region, worker_slot_only=worker_slot_only)
    base = region.base_tensor.data_ptr()
    ranges = sorted((ptr - base, n) for ptr, n in fake.registered.items())
    region.cleanup()  # their own order: cleanup() unregisters what they registered
    assert fake.registered == {} and region.mmap_obj is None
    return ranges


def _mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(path in line for line in f)


@pytest.mark.parametrize("worker_slot_only", [False, True], ids=["whole-rows", "worker-slots"])
@pytest.mark.parametrize("order", ["unpin-then-cleanup", "cleanup-while-pinned"])
def test_their_region_pinned_by_the_drop_in_and_cleaned_up_in_either_order(
    cuda_host: Any, caplog: pytest.LogCaptureFixture, worker_slot_only: bool, order: str
) -> None:
    fake = cuda_host
    theirs = _theirs(fake, worker_slot_only)
    shim = load_shim("vllm_pin_mmap_region", fake)
    region = _region(rank=1)
    base = region.base_tensor.data_ptr()
    shim.pin_mmap_region(region, worker_slot_only=worker_slot_only)
    ours = sorted((ptr - base, n) for ptr, n in fake.registered.items())
    assert region.is_pinned and sorted(a - base for a in region.pinned_addresses) == [o for o, _ in ours]
    if worker_slot_only:  # one page-rounded range per row, this worker's slot: exactly vLLM's calls
        assert ours == theirs and len(ours) == ROWS and sum(n for _, n in ours) == ROWS * SLOT
    else:  # whole rows, contiguous, on row boundaries (vLLM: one call under 64 GiB)
        assert [o for o, _ in ours] == list(itertools.accumulate([0] + [n for _, n in ours[:-1]]))
        assert all(n % (WORKERS * SLOT) == 0 for _, n in ours) and sum(n for _, n in ours) == region.total_size_bytes
        assert ours == theirs == [(0, region.total_size_bytes)]  # one call, as vLLM's
    assert _intact(region)
    registrations, path = len(ours), region.mmap_path
    caplog.set_level("WARNING")

    if order == "unpin-then-cleanup":  # the drop-in's documented order
        shim.unpin_mmap_region(region)
        assert not region.is_pinned and region.pinned_addresses == [] and fake.registered == {}
        assert _intact(region)
        region.cleanup()  # unregisters nothing, unmaps
        assert region.mmap_obj is None
        assert not any("Keeping" in r.getMessage() for r in caplog.records)
    else:  # vLLM's natural order: cleanup() while pinpool's pool is open
        pool = shim._POOLS[id(region)]
        region.cleanup()  # unregisters pinpool's ranges (its pinned_addresses), then mmap.close() -> BufferError
        assert fake.registered == {} and not region.is_pinned
        assert pool.state == pinpool.PoolState.READY  # pinpool still holds the mapping's buffer
        assert region.mmap_obj is not None and any("Keeping" in r.getMessage() for r in caplog.records)
        shim.unpin_mmap_region(region)  # pinpool's close: every range released elsewhere (713), no UnpinError
        assert pool.state == pinpool.PoolState.CLOSED
        elsewhere = [r for r in caplog.records if "chunk.released_elsewhere" in r.getMessage()]
        assert len(elsewhere) == registrations
        del pool
        gc.collect()
        region.mmap_obj.close()  # the recipe: close the mapping vLLM kept, now that nothing exports it
        region.mmap_obj = None
    assert not _mapped(path) and not os.path.exists(path) and fake.registered == {}
