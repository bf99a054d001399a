"""Drop-in for SGLang 0.5.23's host registration (``srt/mem_cache/pool_host/common.py``).

Paste these over ``_cuda_host_register`` / ``_cuda_host_unregister`` (and, to let pinpool own
the memory too, ``alloc_with_host_register``); same names, same signatures. pinpool then
registers in granularity-aligned chunks with rollback, retries a refused chunk in halves down
to one granularity unit, and releases everything on ``HostKVCache.destroy()``.

The recipe (docs/integrations.md): the shim records pinpool's registrations on the tensor as
``_sglang_cuda_host_registered_ranges``, so SGLang's own ``destroy()`` unregisters exactly
pinpool's ranges even with only ``_cuda_host_register`` replaced; pinpool then finds them
released elsewhere (713) and finishes its teardown without leaking. With both functions
replaced, ``destroy()`` closes pinpool's pool directly.

Readiness gate: with ``BACKGROUND = True`` the pool pins after ``__init__`` returns, and SGLang's
``alloc()`` assumes a fully pinned pool, so ``host_pool_ready(buffer)`` must be true before the
host pool hands out a slot (``GatedAlloc`` below does that: ``alloc`` answers None, SGLang's "no
room", until the pool is ready).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

import pinpool
from pinpool import layouts

_CUDA_HOST_REGISTERED_RANGES_ATTR = "_sglang_cuda_host_registered_ranges"  # SGLang's name
_POOL_ATTR = "_pinpool_pool"
RUNTIME: Any = "auto"  # pinpool's runtime: "auto" is CUDA/ROCm on a GPU host; tests set a CudaRuntime
BACKGROUND = False  # True: pin after __init__ returns; gate alloc() with host_pool_ready()


def _chunk_limit() -> int:
    return max(int(os.environ.get("SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB", "256")), 1) << 30


def _open(pool: pinpool.PinnedPool, buffer: torch.Tensor) -> torch.Tensor:
    setattr(buffer, _POOL_ATTR, pool.open())
    if not BACKGROUND:
        _record(buffer)
    return buffer


def _record(buffer: torch.Tensor) -> None:
    pool = getattr(buffer, _POOL_ATTR)
    ranges = [(pool.data_ptr + c.offset, c.nbytes) for c in pool.registrations]
    setattr(buffer, _CUDA_HOST_REGISTERED_RANGES_ATTR, ranges)


def _cuda_host_register(buffer: torch.Tensor, registration_granularity_bytes: int | None = None) -> None:
    g = registration_granularity_bytes
    chunking: dict[str, Any] = {"chunk_bytes": "buffer"} if g is None else {"max_chunk_bytes": _chunk_limit()}
    pool = pinpool.pin(buffer, granularity_bytes=g, runtime=RUNTIME, background=BACKGROUND, name="hicache", **chunking)
    _open(pool, buffer)


def _cuda_host_unregister(buffer: torch.Tensor) -> None:
    pool = getattr(buffer, _POOL_ATTR, None)
    if pool is not None:
        pool.close()  # a range SGLang already released is released elsewhere, not an error
        setattr(buffer, _CUDA_HOST_REGISTERED_RANGES_ATTR, [])


def alloc_with_host_register(
    dims: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
    pin_memory: bool,
    allocator: Any,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:
    """pinpool allocates (an anonymous mapping, as SGLang's ``alloc_mmap``) and pins it."""
    if not pin_memory:
        return allocator.allocate(dims, dtype=dtype, device=device)
    g = registration_granularity_bytes
    # Pages along dim 0; a granularity that is not whole rows is a copy unit within them.
    layout = layouts.Dense((1, *dims[1:]), dtype, granularity_bytes=g)
    chunking: dict[str, Any] = {"chunk_bytes": "buffer"} if g is None else {"max_chunk_bytes": _chunk_limit()}
    pool = pinpool.PinnedPool(layout=layout, num_pages=dims[0], runtime=RUNTIME, background=BACKGROUND, **chunking)
    pool = pool.open()
    buffer = pool.tensor
    assert tuple(buffer.shape) == tuple(dims) and math.prod(dims) == buffer.numel()
    setattr(buffer, _POOL_ATTR, pool)
    if not BACKGROUND:
        _record(buffer)
    return buffer


def host_pool_ready(buffer: torch.Tensor) -> bool:
    """True once every byte of ``buffer`` is pinned (records the ranges then); raises a
    background failure (``PinError``) rather than hand out memory that is not pinned."""
    pool = getattr(buffer, _POOL_ATTR, None)
    if pool is None:
        return True
    if pool.state == pinpool.PoolState.FAILED:
        raise pool.error or pinpool.PinError("background pinning failed")
    if pool.pinned_pages < pool.num_pages:
        return False
    if getattr(buffer, _CUDA_HOST_REGISTERED_RANGES_ATTR, None) is None:
        _record(buffer)
    return True


class GatedAlloc:
    """Mix in before SGLang's host pool class: ``alloc`` hands out nothing until the pool is pinned."""

    kv_buffer: torch.Tensor

    def alloc(self, need_size: int) -> Any:
        if not host_pool_ready(self.kv_buffer):
            return None
        return super().alloc(need_size)  # type: ignore[misc]
