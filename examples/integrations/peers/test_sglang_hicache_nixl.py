"""SGLang 0.5.23's HiCache NIXL storage backend (``HiCacheNixl``) on the drop-in, with a real NIXL agent.

Their backend, their host pool (``MHATokenToKVPoolHost``, built on the CPU), their NIXL agent with
the POSIX plugin: ``register_mem_pool_host`` registers the host side, ``batch_set_v1`` writes pages
to files through NIXL, ``batch_get_v1`` reads them back. The drop-in's pools pin (FakeCudart's
books, really mlocked) and register with that agent (``pinpool.registrars.NixlRegistrar``); the
``fake`` fixture checks that nothing is left pinned. The first test is the failure it prevents, on
their own registration code: a page whose descriptor straddles two registrations does not move."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import load_shim

import pinpool

hicache_nixl = pytest.importorskip("sglang.srt.mem_cache.storage.nixl.hicache_nixl")  # and NIXL itself
if not hasattr(pinpool.registrars, "NixlRegistrar"):
    pytest.skip("pinpool.registrars.NixlRegistrar (issue 35's engine adapters) is not here", allow_module_level=True)
from sglang.srt.mem_cache import device_pool_info as dpi  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host import base  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

HiCacheNixl = hicache_nixl.HiCacheNixl
CPU = torch.device("cpu")
P, L, H, D, PAGES = 16, 4, 4, 64, 64  # page size, layers, heads, head dim, host pages
PAGE_BYTES = L * P * H * D * 2  # one page's K (or V) descriptor in page_first: 32 KiB
MOVED = 24  # pages written and read back


def _host_pool(layout: str) -> Any:
    k = tuple(torch.zeros(P * 8, H, D, dtype=torch.bfloat16) for _ in range(L))
    v = tuple(torch.zeros(P * 8, H, D, dtype=torch.bfloat16) for _ in range(L))
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64) for ts in (k, v)]
    buffers = dpi.KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=dpi.KVBufferLayout.NHD)
    info = dpi.MHABufferInfo(
        buffers=buffers, page_size=P, head_num=H, head_dim=D, v_head_dim=D, dtype=torch.bfloat16, device=CPU
    )
    with base.host_memory_budget_scope(1 << 30):  # their pre-flight, without sampling this shared host
        return MHATokenToKVPoolHost(
            info, host_to_device_ratio=2.0, host_size=0, page_size=P, layout=layout, pin_memory=False,
            device_capacity_tokens=P * 8, start_layer=0, end_layer=L, host_token_capacity=P * PAGES,
        )  # fmt: skip


@pytest.fixture
def store(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Their backend on NIXL's POSIX plugin, files under tmp_path (buffered I/O, no cleaner thread); closed
    again at teardown (a second close() finds nothing), so a failing test leaves nothing registered."""
    monkeypatch.setenv("SGLANG_HICACHE_NIXL_BACKEND_PLUGIN", "POSIX")
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="pinpool/peers",
        extra_config={"use_direct_io": False, "l3_cleaner_enabled": False},
    )  # fmt: skip
    backend = HiCacheNixl(config, file_path=str(tmp_path))
    yield backend
    backend.close()


def _drop_in(fake: Any, monkeypatch: pytest.MonkeyPatch, max_chunk_bytes: int) -> Any:
    shim = load_shim("sglang_hicache_nixl", fake)
    shim.MAX_CHUNK_BYTES = max_chunk_bytes
    for name in ("_pre_register_host", "_alloc_registered", "close"):
        monkeypatch.setattr(HiCacheNixl, name, getattr(shim, name))
    return shim


def _pages(first: int, count: int) -> torch.Tensor:
    return torch.arange(first * P, (first + count) * P)


def _keys(first: int, count: int) -> list[str]:
    return [f"page-{i}" for i in range(first, first + count)]


def _round_trip(store: Any, host: Any) -> None:
    """Their batch_set_v1 then batch_get_v1 of MOVED pages: every page moves, byte-identical."""
    noise = torch.randint(0, 256, (host.kv_buffer.nbytes,), dtype=torch.uint8)
    host.kv_buffer.view(-1).view(torch.uint8).copy_(noise)
    written = host.kv_buffer.clone()
    assert store.batch_set_v1(_keys(0, MOVED), _pages(0, MOVED)) == [True] * MOVED
    host.kv_buffer.zero_()
    assert store.batch_get_v1(_keys(0, MOVED), _pages(0, MOVED)) == [True] * MOVED
    for page in range(MOVED):
        assert torch.equal(_page_of(host.kv_buffer, host, page), _page_of(written, host, page)), f"page {page}"
    assert not torch.equal(_page_of(host.kv_buffer, host, MOVED), _page_of(written, host, MOVED))  # not moved


def _page_of(buffer: torch.Tensor, host: Any, page: int) -> torch.Tensor:
    saved = host.kv_buffer
    host.kv_buffer = buffer
    try:
        return host.get_data_page(page * P, flat=True).clone().view(torch.int16)  # bits: random bf16 has NaNs
    finally:
        host.kv_buffer = saved


def test_their_hand_registration_split_inside_a_page_fails_that_page(store: Any) -> None:
    """The released backend's own registration, done as two halves split inside page 5's K descriptor
    (as a registrar with a size limit and no knowledge of pages would split): page 5 cannot move,
    page 0 can. NIXL finds no registration holding the whole descriptor (NIXL_ERR_NOT_FOUND)."""
    host = _host_pool("page_first")
    store.register_mem_pool_host(host)  # their _pre_register_host: one registration of the kv_buffer
    kv, total = host.kv_buffer.data_ptr(), host.kv_buffer.nbytes
    store.close()  # gives it back, then the same bytes by hand in two halves
    split = 5 * PAGE_BYTES + PAGE_BYTES // 2
    HiCacheNixl._pre_register_host(store, kv, split, "kv_buffer_low")
    HiCacheNixl._pre_register_host(store, kv + split, total - split, "kv_buffer_high")
    try:
        assert store.batch_set_v1(_keys(0, 1), _pages(0, 1)) == [True]
        assert store.batch_set_v1(_keys(5, 1), _pages(5, 1)) == [False]
    finally:
        store.close()


@pytest.mark.parametrize("max_chunk_bytes", [3 * PAGE_BYTES + 4096, 1 << 30], ids=["many-registrations", "one"])
def test_zero_copy_pages_move_through_their_nixl_path_on_pinpools_registrations(
    fake: Any, store: Any, monkeypatch: pytest.MonkeyPatch, max_chunk_bytes: int
) -> None:
    """page_first: their descriptors address the kv_buffer itself; pinpool registers it in whole pages
    (a limit that is not whole pages is cut down to them), each page's descriptor within one registration."""
    _drop_in(fake, monkeypatch, max_chunk_bytes)
    host = _host_pool("page_first")
    store.register_mem_pool_host(host)
    [pool] = store._host_regs
    assert isinstance(pool, pinpool.PinnedPool) and pool.state is pinpool.PoolState.READY
    kv, total = host.kv_buffer.data_ptr(), host.kv_buffer.nbytes
    assert sorted(fake.registered.items()) == [(pool.data_ptr + c.offset, c.nbytes) for c in pool.registrations]
    assert sum(fake.registered.values()) == total and pool.data_ptr == kv
    registrations = pool.transfer_registrations("nixl")
    assert sum(r.nbytes for r in registrations) == total
    assert all(r.offset % PAGE_BYTES == 0 and r.nbytes % PAGE_BYTES == 0 for r in registrations)
    if max_chunk_bytes < total:
        assert len(registrations) > 2 and all(r.nbytes <= max_chunk_bytes for r in registrations)
    ptrs, sizes = host.get_page_buffer_meta(_pages(0, PAGES))
    for ptr, size in zip(ptrs, sizes, strict=True):  # every descriptor they build: one piece, one registration
        assert len(pool.transfer_pieces("nixl", offset=ptr - kv, nbytes=size)) == 1
    _round_trip(store, host)
    handles = [r.handle for r in registrations]
    store.close()
    assert pool.state is pinpool.PoolState.CLOSED and store._host_regs == []
    for handle in handles:  # the agent holds none of them now
        with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
            store.agent.deregister_memory(handle)


def test_bounce_buffers_are_pinpools_pools_on_the_copy_path(
    fake: Any, store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """layer_first is not zero-copy: their backend stages pages through two bounce buffers, which the
    drop-in maps, pins and registers (SGLang's own are pageable: ``pin_memory`` is unused there)."""
    _drop_in(fake, monkeypatch, 1 << 30)
    host = _host_pool("layer_first")
    store.register_mem_pool_host(host)
    assert not store.is_zero_copy
    pools = list(store._host_regs)
    assert len(pools) == 2 and all(isinstance(p, pinpool.PinnedPool) for p in pools)
    assert [store._bounce_set.data_ptr(), store._bounce_get.data_ptr()] == [p.data_ptr for p in pools]
    assert sum(fake.registered.values()) == sum(p.nbytes for p in pools)
    assert all(p.transfer_registrations("nixl") for p in pools)
    _round_trip(store, host)
    store.close()
    assert all(p.state is pinpool.PoolState.CLOSED for p in pools) and store._bounce_set is None
