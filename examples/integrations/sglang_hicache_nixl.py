"""Drop-in for SGLang 0.5.23's HiCache NIXL storage backend (``srt/mem_cache/storage/nixl/hicache_nixl.py``).

Paste these over ``HiCacheNixl._pre_register_host``, ``HiCacheNixl._alloc_registered`` and
``HiCacheNixl.close``; same names, same signatures. SGLang registers its host regions with its NIXL
agent by hand, each as one ``register_memory`` of the whole region, and ``close()`` drops a failed
``deregister_memory`` at debug level. With these, pinpool pins each region and registers it with the
agent (``pinpool.registrars.NixlRegistrar``) from one plan: registrations are whole KV pages (the
descriptor SGLang builds per page, ``get_page_buffer_meta``) so no page's descriptor straddles two,
a failure rolls back both, and ``close()`` deregisters every registration before the memory is unpinned.

- ``_pre_register_host(base_addr, total_size, kind)``: the zero-copy path (``page_first`` layouts),
  the host pool's own ``kv_buffer``. pinpool pins memory it does not own (``pinpool.pin``), so the
  host pool must not already be pinned by another pinpool pool: pinpool refuses a second pin of the
  same bytes (``AlreadyPinnedError``). SGLang builds the host pool before the storage backend's agent,
  so this pool is the one that pins it: allocate it pageable (``pin_memory=False``), or build the agent
  first and pass ``registrars=[NixlRegistrar(agent)]`` where the host pool is allocated.
- ``_alloc_registered(page_numel, dtype, pin_memory, kind)``: the bounce buffers of the other
  layouts. pinpool maps them (page-aligned, as SGLang's ``alloc_mmap``), pins and registers them.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

import pinpool
from pinpool import layouts

logger = logging.getLogger(__name__)
RUNTIME: Any = "auto"  # pinpool's runtime; tests set a CudaRuntime on pinpool.testing.FakeCudart
MAX_CHUNK_BYTES: int | None = None  # None: pinpool's plan; tests make it small so a region has many registrations
STORAGE_BATCH_SIZE = 128  # SGLang's (mem_cache/hicache_storage.py): pages per bounce buffer


def _registrar(self: Any) -> Any:
    """One NixlRegistrar per HiCacheNixl agent, shared by its regions' pools (it serializes calls to the agent)."""
    registrar = getattr(self, "_pinpool_registrar", None)
    if registrar is None:
        from pinpool.registrars import NixlRegistrar  # type: ignore[attr-defined]

        registrar = self._pinpool_registrar = NixlRegistrar(self.agent, name="nixl")
    return registrar


def _page_bytes(self: Any, base_addr: int) -> int | None:
    """The bytes of the descriptor SGLang addresses one page of the kv_buffer with (None: not the kv_buffer)."""
    host = getattr(self, "mem_pool_host", None)
    kv = getattr(host, "kv_buffer", None)
    if kv is None or kv.data_ptr() != base_addr or not hasattr(host, "get_page_buffer_meta"):
        return None
    _ptrs, sizes = host.get_page_buffer_meta(torch.arange(host.page_size))
    return int(sizes[0])


def _options() -> dict[str, Any]:
    return {} if MAX_CHUNK_BYTES is None else {"max_chunk_bytes": MAX_CHUNK_BYTES}


def _keep(self: Any, pool: pinpool.PinnedPool) -> None:
    # _host_regs non-empty is SGLang's "registered" test (batch_get_v1/batch_set_v1); close() tells them apart.
    self._host_regs.append(pool.open())


def _pre_register_host(self: Any, base_addr: int, total_size: int, kind: str) -> None:
    """Pin ``[base_addr, base_addr + total_size)`` and register it with ``self.agent``, in whole pages."""
    page = _page_bytes(self, base_addr)
    region = (ctypes.c_uint8 * total_size).from_address(base_addr)  # the caller's memory: pinpool never frees it
    rows = torch.frombuffer(region, dtype=torch.uint8)
    if page is not None and total_size % page == 0:
        # Rows are pages, but a chunk limit splits rows unless the copy unit says otherwise: descriptors
        # SGLang builds itself (not pool.transfer_pieces) must never straddle two registrations.
        rows = rows.view(total_size // page, page)
        chunking = {"granularity_bytes": page, **_options()}
    else:
        chunking = {"chunk_bytes": "buffer"}  # page unknown: one registration, as SGLang's
    pool = pinpool.pin(rows, runtime=RUNTIME, registrars=[_registrar(self)], name=f"hicache-nixl-{kind}", **chunking)
    _keep(self, pool)


def _alloc_registered(self: Any, page_numel: int, dtype: torch.dtype, pin_memory: bool, kind: str) -> torch.Tensor:
    """A ``(STORAGE_BATCH_SIZE, page_numel)`` bounce buffer that pinpool maps, pins and registers."""
    layout = layouts.Dense((1, page_numel), dtype)
    pool = pinpool.PinnedPool(
        layout=layout, num_pages=STORAGE_BATCH_SIZE, runtime=RUNTIME, registrars=[_registrar(self)],
        name=f"hicache-nixl-{kind}", **_options(),
    )  # fmt: skip
    _keep(self, pool)
    return pool.tensor


def close(self: Any) -> None:
    """SGLang's close(), with pinpool's pools closed (deregistered, unpinned, bounce buffers unmapped)
    last-registered first; a failure to let go raises (``UnpinError``) instead of a debug line."""
    if self._l3_cleaner is not None:
        self._l3_cleaner.stop()
        self._l3_cleaner = None
    # Their views of pinpool's bounce buffers go before the pools that own the memory.
    self._bounce_set = None
    self._bounce_get = None
    self._bounce_page_bytes = None
    self._hybrid_pool_ctx.clear()
    errors: list[BaseException] = []
    while self._host_regs:
        reg = self._host_regs.pop()
        try:
            if isinstance(reg, pinpool.PinnedPool):
                reg.close()
            else:
                self.agent.deregister_memory(reg)  # one SGLang registered itself
        except Exception as exc:  # close every other region first, then raise the first failure
            errors.append(exc)
    if errors:
        raise errors[0]
