"""LMCache 0.5.6's NIXL L2 store agent (``NixlStorageAgent``) on the drop-in, with a real NIXL agent.

Their agent on NIXL's POSIX plugin (files in a temporary directory) over an L1 arena (an anonymous
mapping, as LMCache's): ``init_mem_handlers`` registers the arena and preps one descriptor per page,
``get_mem_to_storage_handle`` / ``get_storage_to_mem_handle`` and ``post_blocking`` move pages. The
drop-in's pool pins (FakeCudart's books, really mlocked) and registers with their agent in whole
pages within a registrar limit; the ``fake`` fixture checks that nothing is left pinned."""

from __future__ import annotations

import mmap
from typing import Any

import pytest
import torch
from conftest import load_shim

import pinpool

l2 = pytest.importorskip("lmcache.v1.distributed.l2_adapters.nixl_store_l2_adapter")  # and NIXL itself
if not hasattr(pinpool.registrars, "NixlRegistrar"):
    pytest.skip("pinpool.registrars.NixlRegistrar (issue 35's engine adapters) is not here", allow_module_level=True)
from lmcache.v1.distributed.internal_api import L1MemoryDesc  # noqa: E402

PAGE, PAGES, MOVED = 64 << 10, 48, 20  # LMCache's align_bytes, the arena's pages, pages moved


@pytest.mark.parametrize("max_bytes", [3 * PAGE + 4096, None], ids=["limit-3-pages", "no-limit"])
def test_pages_move_through_their_agent_on_pinpools_registrations(
    fake: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, max_bytes: int | None
) -> None:
    shim = load_shim("lmcache_nixl_store", fake)
    shim.MAX_BYTES = max_bytes
    monkeypatch.setattr(l2.NixlStorageAgent, "init_mem_handlers", shim.init_mem_handlers)
    monkeypatch.setattr(l2.NixlStorageAgent, "close", shim.close)
    arena_map = mmap.mmap(-1, PAGES * PAGE)
    arena = torch.frombuffer(arena_map, dtype=torch.uint8)
    desc = L1MemoryDesc(ptr=arena.data_ptr(), size=arena.nbytes, align_bytes=PAGE)
    params = {"file_path": str(tmp_path), "use_direct_io": "false"}
    agent = l2.NixlStorageAgent(
        device="cpu", backend="POSIX", backend_params=params, pool_size=MOVED, l1_memory_desc=desc
    )
    try:
        pool = agent._pinpool_pool
        registrations = pool.transfer_registrations("nixl")
        assert pool.data_ptr == arena.data_ptr() and sum(fake.registered.values()) == arena.nbytes
        assert sum(r.nbytes for r in registrations) == arena.nbytes
        assert all(r.offset % PAGE == 0 and r.nbytes % PAGE == 0 for r in registrations)
        if max_bytes is not None:
            assert len(registrations) == PAGES // 3 and all(r.nbytes == 3 * PAGE for r in registrations)
        arena.copy_(torch.randint(0, 256, (arena.nbytes,), dtype=torch.uint8))
        written = arena.clone()
        slots = agent.get_storage_indices(MOVED)
        for make in (agent.get_mem_to_storage_handle, None, agent.get_storage_to_mem_handle):
            if make is None:
                arena.zero_()
                continue
            handle = make(list(range(MOVED)), slots)
            agent.post_blocking(handle)
            agent.release_handle(handle)
        moved = MOVED * PAGE
        assert torch.equal(arena[:moved], written[:moved]) and not arena[moved:].any()
        handles = [r.handle for r in registrations]
    finally:
        agent.close()
    assert pool.state is pinpool.PoolState.CLOSED
    for handle in handles:  # the agent holds none of them now
        with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
            agent.nixl_agent.deregister_memory(handle)
    del arena
    arena_map.close()
