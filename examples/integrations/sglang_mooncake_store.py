"""Drop-in for SGLang 0.5.23's HiCache Mooncake store (``srt/mem_cache/storage/mooncake_store/mooncake_store.py``).

Paste these over ``MooncakeBaseStore.register_buffer`` and ``MooncakeStore.close``; same names, same
signatures. SGLang registers each host buffer with its ``MooncakeDistributedStore`` by hand, one
``register_buffer(ptr, size)`` per buffer, and never unregisters (``close()`` is ``pass``: "the
destructor"). With these, pinpool pins each buffer and registers it with the store (``StoreRegistrar``
below: the store is not a ``TransferEngine``, so not ``MooncakeRegistrar``) in whole KV pages, rolls
both back on a failure, and ``close()`` unregisters every registration before the memory is unpinned.

The host pool must not already be pinned by another pinpool pool (pinpool refuses a second pin of
the same bytes): SGLang builds it before the store, so allocate it pageable (``pin_memory=False``) and
let this pool pin it, or build the store first and pass the registrar where the host pool is allocated.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

import pinpool
from pinpool import RuntimeCallError
from pinpool.registrars import RegistrarLimits

RUNTIME: Any = "auto"  # pinpool's runtime; tests set a CudaRuntime on pinpool.testing.FakeCudart
MAX_CHUNK_BYTES: int | None = None  # None: pinpool's plan; tests make it small so a buffer has many registrations
INVALID_PARAMS = -600  # Mooncake's store: unregister_buffer of an address it does not hold (0.3.13.post1)


class StoreRegistrar:
    """A ``MooncakeDistributedStore`` as a pinpool registrar: ``register_buffer(ptr, n)`` /
    ``unregister_buffer(ptr)``, each non-zero answer a typed error (nothing was done)."""

    def __init__(self, store: Any, name: str = "mooncake-store") -> None:
        self.store, self.name = store, name
        self.limits = RegistrarLimits(not_registered_codes=frozenset({INVALID_PARAMS}), parallel=False)
        self._lock = threading.Lock()  # parallel=False: one call at a time, as SGLang made them

    def _check(self, op: str, rc: int, ptr: int, nbytes: int) -> None:
        if rc != 0:
            hint = "nothing is registered at this address" if rc == INVALID_PARAMS else "see the store's log"
            raise RuntimeCallError(
                op=op, code=rc, reason="MooncakeStoreError", ptr=ptr, nbytes=nbytes,
                message=f"MooncakeDistributedStore.{op}_buffer answered {rc}: {hint}",
            )  # fmt: skip

    def register(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self._check("register", int(self.store.register_buffer(ptr, nbytes)), ptr, nbytes)

    def unregister(self, ptr: int, nbytes: int, handle: object) -> None:
        with self._lock:
            self._check("unregister", int(self.store.unregister_buffer(ptr)), ptr, nbytes)


def _page_bytes(self: Any, tensor: torch.Tensor) -> int | None:
    """The bytes of the descriptor SGLang addresses one page of the kv_buffer with, where ``tensor`` is the
    kv_buffer or whole pages of it (MHA registers its K and V halves apart); None for another buffer."""
    host = getattr(self, "mem_pool_host", None)
    kv = getattr(host, "kv_buffer", None)
    if kv is None or not hasattr(host, "get_page_buffer_meta"):
        return None
    _ptrs, sizes = host.get_page_buffer_meta(torch.arange(host.page_size))
    page, start = int(sizes[0]), tensor.data_ptr() - kv.data_ptr()
    inside = 0 <= start and start + tensor.numel() * tensor.element_size() <= kv.numel() * kv.element_size()
    return page if inside and start % page == 0 else None


def register_buffer(self: Any, tensor: torch.Tensor) -> None:
    """Pin ``tensor`` and register it with ``self.store``, in whole pages of the kv_buffer."""
    if self.store is None:
        raise RuntimeError("Mooncake store is not initialized.")
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        return  # conv-only models have a 0-element ssm state; nothing to register (SGLang's case)
    registrar = getattr(self, "_pinpool_registrar", None)
    if registrar is None:
        registrar = self._pinpool_registrar = StoreRegistrar(self.store)
    page = _page_bytes(self, tensor)
    region = (ctypes.c_uint8 * size).from_address(tensor.data_ptr())  # theirs: pinpool never frees it
    rows = torch.frombuffer(region, dtype=torch.uint8)
    options: dict[str, Any] = {"chunk_bytes": "buffer"}  # page unknown: one registration, as SGLang's
    if page is not None and size % page == 0:
        rows = rows.view(size // page, page)  # a page's descriptor never straddles two registrations
        options = {
            "granularity_bytes": page,
            **({} if MAX_CHUNK_BYTES is None else {"max_chunk_bytes": MAX_CHUNK_BYTES}),
        }
    pool = pinpool.pin(rows, runtime=RUNTIME, registrars=[registrar], name="hicache-mooncake", **options)
    self._pinpool_pools = [*getattr(self, "_pinpool_pools", []), pool.open()]


def close(self: Any) -> None:
    """Unregister and unpin every buffer, last first; raise the first failure after trying them all."""
    errors: list[BaseException] = []
    pools = getattr(self, "_pinpool_pools", [])
    while pools:
        try:
            pools.pop().close()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
