"""Drop-ins for LMCache 0.5.6's pinned CPU memory (``v1/memory_management.py``, ``memory_allocators/``).

``_allocate_cpu_memory`` / ``_free_cpu_memory``: same signatures; pinpool maps (private, or the
named shm LMCache's Mixed allocator asks for; 2 MiB pages on request; on the GPU's NUMA node),
pins and releases the arena. The Pin and Mixed allocators then run unchanged. A failure raises
(``PinError``) with nothing left pinned: no unpinned arena is handed out.

``lazy_allocator(LazyMemoryAllocator, TensorMemoryAllocator)`` makes the lazy allocator's
subclass: one background pool pins 64 MiB steps, and the readiness gate opens the allocator's
address space (``sbrk``) only over pages pinpool says are pinned (``pool.pinned_pages``), so a
step that fails stops the arena where it is instead of handing out unpinned memory.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

import pinpool
from pinpool import layouts

logger = logging.getLogger(__name__)
RUNTIME: Any = "auto"  # pinpool's runtime; tests set a CudaRuntime on pinpool.testing.FakeCudart
_POOLS: dict[int, pinpool.PinnedPool] = {}  # arena address -> its pool


def _numa_node(numa_mapping: Any) -> int | None:
    if numa_mapping is None:
        return None
    device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return int(numa_mapping.gpu_to_numa_mapping[device])


def _allocate_cpu_memory(
    size: int, numa_mapping: Any = None, shm_name: str | None = None, use_hugepages: bool = False
) -> torch.Tensor:
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    memory = pinpool.SharedMemory(f"/dev/shm/{shm_name.lstrip('/')}", create=True) if shm_name else None
    pool = pinpool.PinnedPool(
        layout=layouts.Raw(), size=size, memory=memory, huge_pages="hugetlb" if use_hugepages else False,
        numa_node=_numa_node(numa_mapping), runtime=RUNTIME, name="lmcache-l1",
    ).open()  # fmt: skip
    _POOLS[pool.data_ptr] = pool
    return pool.tensor


def _free_cpu_memory(buffer: torch.Tensor, size: int | None = None, *args: Any, **kwargs: Any) -> None:
    _POOLS.pop(buffer.data_ptr()).close()


def lazy_allocator(base: type, tensor_allocator: type) -> type:
    """LMCache's ``LazyMemoryAllocator`` on one background pinpool pool (pass the two classes)."""

    class PinpoolLazyMemoryAllocator(base):  # type: ignore[valid-type,misc]
        def __init__(self, init_size: int, final_size: int, align_bytes: int = 4096, numa_mapping: Any = None):
            step = self.PIN_CHUNK_SIZE
            self._use_numa = False  # pinpool owns the memory (numa_node=), close() frees it
            self._final_size = -(-final_size // step) * step
            self._pool = pinpool.PinnedPool(
                layout=layouts.Raw(), size=self._final_size, background=True, chunk_bytes=step,
                numa_node=_numa_node(numa_mapping), runtime=RUNTIME, name="lmcache-lazy",
            ).open()  # fmt: skip
            self._buffer, self._align = self._pool.tensor, align_bytes
            if self._buffer.data_ptr() % align_bytes:
                self._pool.close()
                raise RuntimeError(f"pinpool's arena is not aligned to align_bytes={align_bytes}")
            init = min(-(-init_size // step) * step, self._final_size)
            self._curr_size = self._pool.wait_ready_sync(min_bytes=init) if init else 0  # raises a failure
            self._curr_size -= self._curr_size % align_bytes
            self._pin_record: list[tuple[int, int]] = []  # pinpool keeps the books
            self._allocator = tensor_allocator(
                self._buffer, align_bytes=align_bytes, init_address_space=self._curr_size
            )
            self._address_manager = self._allocator.address_manager
            self._stop_expand = threading.Event()
            self._expand_thread = threading.Thread(target=self._expand_worker, daemon=True, name="lazy-mem-expand")
            self._expand_thread.start()

        def _expand_worker(self) -> None:
            """The readiness gate: open the address space only over the pinned prefix."""
            while self._curr_size < self._final_size and not self._stop_expand.wait(0.005):
                pinned = self._pool.pinned_pages  # a Raw pool's page is one byte
                pinned -= pinned % self._align
                if pinned > self._curr_size:
                    self._commit_expansion(pinned - self._curr_size)
                    self._curr_size = pinned
                if self._pool.state == pinpool.PoolState.FAILED:
                    try:  # a waiter takes the failure (pool.error only reads it): close() then does not raise it
                        self._pool.wait_ready_sync()
                    except pinpool.PinError as failure:
                        logger.warning("lazy pinning failed; the arena stays at %d bytes: %s", pinned, failure)
                    return

        def close(self) -> None:
            self._stop_expand.set()
            self._expand_thread.join()
            self._pool.close()

    return PinpoolLazyMemoryAllocator
