"""Drop-in for vLLM 0.34.0's ``pin_mmap_region`` (``v1/kv_offload/cpu/gpu_worker.py``).

Both of vLLM's modes, same signature: whole-row chunks of at most 64 GiB, or (the default for
non-canonical layouts) one page-rounded range per row covering only this worker's slot. One
pinpool pool holds them all; it fills ``region.pinned_addresses`` / ``region.is_pinned`` as
vLLM's own function does, and a failure leaves the region pageable with a warning, as vLLM's.

The recipe (docs/integrations.md): call ``unpin_mmap_region(region)`` before ``region.cleanup()``:
it closes the pool (which holds the mapping's buffer: ``mmap.close()`` would raise BufferError
under it) and clears ``pinned_addresses`` / ``is_pinned`` so cleanup() unregisters nothing. In
the other order cleanup() unregisters pinpool's ranges, pinpool then finds them released
elsewhere (713) and lets go, and the mapping vLLM kept can be closed.

Readiness gate: ``pin_mmap_region(..., background=True)`` leaves ``is_pinned`` False (vLLM then
copies as from pageable memory) until ``region_ready(region)`` sees every range pinned.
"""

from __future__ import annotations

import logging
from typing import Any

import pinpool

logger = logging.getLogger(__name__)
RUNTIME: Any = "auto"  # pinpool's runtime; tests set a CudaRuntime on pinpool.testing.FakeCudart
MAX_HOST_REGISTER_CHUNK_BYTES = 64 * 1024**3  # vLLM's
MIN_HOST_REGISTER_SAVED_BYTES = 3 * 1024**2  # vLLM's
_POOLS: dict[int, pinpool.PinnedPool] = {}  # id(region) -> its pool


def pin_mmap_region(region: Any, worker_slot_only: bool = False, *, background: bool = False) -> None:
    stride, slot, page = region._row_stride, region.cpu_page_size, region.page_size
    if worker_slot_only and region.rank is not None and stride - slot >= max(page, MIN_HOST_REGISTER_SAVED_BYTES):
        shape: dict[str, Any] = {"ranges": list(region.iter_worker_slot_ranges())}
    else:  # whole rows, as few calls as 64 GiB allows
        shape = {
            "granularity_bytes": stride,
            "max_chunk_bytes": max(MAX_HOST_REGISTER_CHUNK_BYTES // stride, 1) * stride,
        }
    try:
        pool = pinpool.pin(region._base, runtime=RUNTIME, background=background, name="vllm-offload", **shape).open()
    except pinpool.PinpoolError as error:  # rolled back; the region stays pageable, as vLLM's
        logger.warning("pinning the offload region failed; it stays pageable: %s", error)
        return
    _POOLS[id(region)] = pool
    region_ready(region)


def region_ready(region: Any) -> bool:
    """True once the region is pinned (sets ``is_pinned`` and ``pinned_addresses`` then)."""
    pool = _POOLS.get(id(region))
    if pool is None or pool.pinned_pages < pool.num_pages:
        return False
    if not region.is_pinned:
        region.pinned_addresses.extend(pool.data_ptr + c.offset for c in pool.registrations)
        region.is_pinned = True
    return True


def unpin_mmap_region(region: Any) -> None:
    """Before ``region.cleanup()``: unpin, and leave cleanup() nothing to unregister."""
    pool = _POOLS.pop(id(region), None)
    if pool is not None:
        region.pinned_addresses.clear()
        region.is_pinned = False
        pool.close()
