"""Drop-in for LMCache 0.5.6's NIXL L2 store (``v1/distributed/l2_adapters/nixl_store_l2_adapter.py``).

Paste these over ``NixlStorageAgent.init_mem_handlers`` and ``NixlStorageAgent.close``; same names,
same signatures. LMCache registers its L1 arena with the agent as one DRAM registration and builds
one transfer descriptor per ``align_bytes`` page. With these, pinpool pins the arena and registers it
with the agent (``pinpool.registrars.NixlRegistrar``) in whole pages, within the registrar's limit
(``MAX_BYTES``: a plugin's largest registration), rolled back on a failure; ``close()`` deregisters
every registration before the memory is unpinned.

The arena must not already be pinned by another pinpool pool (``lmcache_pinned_memory.py``'s
``_allocate_cpu_memory``): LMCache builds it before this agent, so allocate it unpinned, or build the
agent first and pass the registrar where the arena is allocated.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

import pinpool

RUNTIME: Any = "auto"  # pinpool's runtime; tests set a CudaRuntime on pinpool.testing.FakeCudart
MAX_BYTES: int | None = None  # the largest registration the agent's plugin takes (None: pinpool's plan)


def init_mem_handlers(
    self: Any, device: str, buffer_ptr: int, buffer_size: int, page_size: int, device_id: int
) -> None:
    """Pin and register ``[buffer_ptr, buffer_ptr + buffer_size)`` in whole pages; one descriptor a page."""
    if device != "cpu" or buffer_size % page_size:
        raise ValueError(f"pinpool registers a host arena of whole pages, not {buffer_size} B on {device!r}")
    from pinpool.registrars import NixlRegistrar  # type: ignore[attr-defined]

    registrar = NixlRegistrar(self.nixl_agent, name="nixl", dev_id=device_id, max_bytes=MAX_BYTES)
    region = (ctypes.c_uint8 * buffer_size).from_address(buffer_ptr)  # LMCache's arena: pinpool never frees it
    pages = torch.frombuffer(region, dtype=torch.uint8).view(buffer_size // page_size, page_size)
    self._pinpool_pool = pinpool.pin(
        pages, runtime=RUNTIME, registrars=[registrar], granularity_bytes=page_size, name="lmcache-l2-nixl"
    ).open()
    xfer_descs = self.nixl_agent.get_xfer_descs(
        [(addr, page_size, device_id) for addr in range(buffer_ptr, buffer_ptr + buffer_size, page_size)], "DRAM"
    )
    self.mem_xfer_handler = self.nixl_agent.prep_xfer_dlist("", xfer_descs, mem_type="DRAM")
    self.mem_reg_descs = None  # pinpool holds the registrations


def close(self: Any) -> None:
    """LMCache's close(), with the arena's registrations released by pinpool (a failure raises)."""
    self.nixl_agent.release_dlist_handle(self.storage_xfer_handler)
    self.nixl_agent.release_dlist_handle(self.mem_xfer_handler)
    self.nixl_agent.deregister_memory(self.storage_reg_descs)
    try:
        self._pinpool_pool.close()
    finally:
        for fd in getattr(self, "storage_fds", []):
            os.close(fd)
