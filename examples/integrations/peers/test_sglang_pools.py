"""SGLang 0.5.23's MHATokenToKVPoolHost / MLATokenToKVPoolHost built whole on the drop-in.

Each pool is built twice from the same device-pool description: pinned (``pin_memory=True``,
the drop-in underneath, as an adopter pastes it into ``pool_host/common.py``) and unpinned
(``pin_memory=False``, their own path). Everything their code derives from the buffer must be
identical: shapes, strides, per-layer views, kernel pointer tables (relative to the buffer),
data written through their API, alloc/free. Then ``destroy()`` (twice: it is idempotent) and
pinpool's close run in either order; the ``fake`` fixture checks FakeCudart's books are empty
and VmLck is back.

How their code resolves the names: ``alloc_with_host_register`` calls ``_cuda_host_register``
from ``common``'s globals; ``ALLOC_MEMORY_FUNCS`` (a defaultdict) looks ``alloc_with_host_register``
up in ``common`` on first use of a device type and then keeps it, so the ``cpu`` entry is dropped
to make it look again; ``HostKVCache.destroy()`` calls the ``_cuda_host_unregister`` that
``base`` imported, and only where ``base._is_cuda or base._is_hip`` (set True: a CUDA host)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import load_shim

import pinpool

common = pytest.importorskip("sglang.srt.mem_cache.pool_host.common")
from sglang.srt.mem_cache import device_pool_info as dpi  # noqa: E402
from sglang.srt.mem_cache.pool_host import base  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402

CPU = torch.device("cpu")
P, L, H, D, PAGES = 16, 4, 4, 64, 256  # page size, layers, heads, head dim, host pages
KV_LORA, ROPE = 448, 64  # MLA row: 512 elements
MODES = ["register", "register+unregister", "alloc"]  # which of their functions the adopter replaced


def _mha_info() -> Any:
    k = tuple(torch.zeros(P * 8, H, D, dtype=torch.bfloat16) for _ in range(L))
    v = tuple(torch.zeros(P * 8, H, D, dtype=torch.bfloat16) for _ in range(L))
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64) for ts in (k, v)]
    buffers = dpi.KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=dpi.KVBufferLayout.NHD)
    return dpi.MHABufferInfo(
        buffers=buffers, page_size=P, head_num=H, head_dim=D, v_head_dim=D, dtype=torch.bfloat16, device=CPU
    )


def _mla_info() -> Any:
    rows = tuple(torch.zeros(P * 8, 1, KV_LORA + ROPE, dtype=torch.bfloat16) for _ in range(L))
    return dpi.MLABufferInfo(
        buffers=rows, data_ptrs=torch.tensor([t.data_ptr() for t in rows], dtype=torch.uint64),
        layer_indices=tuple(range(L)), device_layer_num=L, page_size=P, kv_lora_rank=KV_LORA,
        qk_rope_head_dim=ROPE, kv_cache_dim=KV_LORA + ROPE, dtype=torch.bfloat16, device=CPU,
    )  # fmt: skip


def _build(kind: str, layout: str, pin_memory: bool) -> Any:
    common_args = {
        "host_to_device_ratio": 2.0, "host_size": 0, "page_size": P, "layout": layout, "pin_memory": pin_memory,
        "device_capacity_tokens": P * 8, "start_layer": 0, "end_layer": L, "host_token_capacity": P * PAGES,
    }  # fmt: skip
    with base.host_memory_budget_scope(1 << 30):  # their pre-flight, without sampling this shared host
        if kind == "mha":
            return MHATokenToKVPoolHost(_mha_info(), head_group_num=2 if layout == "page_unified" else 1, **common_args)
        return MLATokenToKVPoolHost(_mla_info(), target_layer_num=L, **common_args)


def _refs(pool: Any) -> list[torch.Tensor]:
    return (
        list(getattr(pool, "k_data_refs", None) or [])
        + list(getattr(pool, "v_data_refs", None) or [])
        + list(getattr(pool, "data_refs", None) or [])
    )


def _tables(pool: Any) -> list[list[int]]:
    base_ptr = pool.kv_buffer.data_ptr()
    names = ("k_data_ptrs", "v_data_ptrs", "data_ptrs")
    tables = [getattr(pool, n, None) for n in names]
    return [[int(p) - base_ptr for p in t.tolist()] for t in tables if t is not None]


def _geometry(pool: Any) -> tuple[Any, ...]:
    buf, base_ptr = pool.kv_buffer, pool.kv_buffer.data_ptr()
    refs = [(tuple(r.shape), r.stride(), r.data_ptr() - base_ptr) for r in _refs(pool)]
    return (tuple(buf.shape), buf.stride(), buf.dtype, pool.size, pool.page_num, refs, _tables(pool))


def _write_through_their_api(pool: Any, layout: str) -> None:
    gen = torch.Generator().manual_seed(22)
    if layout in ("page_unified",):  # their get/set_from_flat_data_page refuse it: write the fused page
        for page in (0, 7, PAGES - 1):
            pool.kv_buffer[page].copy_(torch.randn(pool.kv_buffer[page].shape, generator=gen))
        return
    flat_len = pool.get_data_page(0).numel()
    for index in (0, 7 * P, (PAGES - 1) * P):
        pool.set_from_flat_data_page(index, torch.randn(flat_len, generator=gen).to(pool.dtype))


def _install(monkeypatch: pytest.MonkeyPatch, shim: Any, mode: str) -> None:
    monkeypatch.setattr(base, "_is_cuda", True)  # destroy() unregisters, as on a CUDA host
    monkeypatch.delitem(common.ALLOC_MEMORY_FUNCS, "cpu", raising=False)
    monkeypatch.setattr(common, "_cuda_host_register", shim._cuda_host_register)
    if mode in ("register+unregister", "alloc"):
        monkeypatch.setattr(common, "_cuda_host_unregister", shim._cuda_host_unregister)
        monkeypatch.setattr(base, "_cuda_host_unregister", shim._cuda_host_unregister)
    if mode == "alloc":
        monkeypatch.setattr(common, "alloc_with_host_register", shim.alloc_with_host_register)


LAYOUTS = [("mha", lo) for lo in ("layer_first", "page_first", "page_first_direct", "page_head", "page_unified")]
LAYOUTS += [("mla", lo) for lo in ("layer_first", "page_first", "page_first_direct", "page_unified")]


@pytest.mark.parametrize("order", ["sglang-first", "pinpool-first"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("kind", "layout"), LAYOUTS)
def test_their_host_pool_on_the_drop_in_is_their_unpinned_pool(
    fake: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kind: str,
    layout: str,
    mode: str,
    order: str,
) -> None:
    shim = load_shim("sglang_host_register", fake)
    _install(monkeypatch, shim, mode)
    plain = _build(kind, layout, pin_memory=False)
    assert fake.registered == {}  # their unpinned path registers nothing
    pinned = _build(kind, layout, pin_memory=True)
    buf = pinned.kv_buffer
    pool = buf._pinpool_pool
    assert pool.state == pinpool.PoolState.READY and pool.pinned_bytes == buf.numel() * buf.element_size()
    assert sorted(fake.registered.items()) == sorted(buf._sglang_cuda_host_registered_ranges)
    assert sum(fake.registered.values()) == buf.numel() * buf.element_size()
    registrations = len(fake.registered)
    if mode == "alloc":
        assert buf.data_ptr() == pool.data_ptr  # pinpool's mapping under their pool
    assert _geometry(pinned) == _geometry(plain)

    _write_through_their_api(pinned, layout)
    _write_through_their_api(plain, layout)
    assert torch.equal(pinned.kv_buffer, plain.kv_buffer)
    if layout != "page_unified":
        assert torch.equal(pinned.get_data_page(7 * P), plain.get_data_page(7 * P))

    slots = [pinned.alloc(P * 3), plain.alloc(P * 3)]
    assert slots[0] is not None and torch.equal(slots[0], slots[1])
    assert pinned.free(slots[0]) == plain.free(slots[1]) == P * 3
    assert pinned.available_size() == plain.available_size() == P * PAGES

    caplog.set_level("WARNING")
    if order == "sglang-first":
        pinned.destroy()
        pinned.destroy()  # idempotent
        shim._cuda_host_unregister(buf)  # pinpool's close: released elsewhere or already closed
    else:
        shim._cuda_host_unregister(buf)
        pinned.destroy()
        pinned.destroy()
    assert pool.state == pinpool.PoolState.CLOSED and pinned.kv_buffer is None
    assert fake.registered == {} and buf._sglang_cuda_host_registered_ranges == []
    # Only their own unregister, run first, releases pinpool's ranges under it: 713 on each, no UnpinError.
    elsewhere = [r for r in caplog.records if "chunk.released_elsewhere" in r.getMessage()]
    assert len(elsewhere) == (registrations if (mode, order) == ("register", "sglang-first") else 0)
    plain.destroy()


def _kv_split(pin_memory: bool) -> Any:
    native = dpi.MLASplitBuffers(
        k=torch.zeros(L, P * 8, 1, KV_LORA, dtype=torch.bfloat16),
        v=torch.zeros(L, P * 8, 1, ROPE, dtype=torch.bfloat16),
        index_k=None, index_scales=None, index_layer_indices=(), k_width=KV_LORA, v_width=ROPE, index_width=0,
    )  # fmt: skip
    info = dpi.MLABufferInfo(
        buffers=native, data_ptrs=None, layer_indices=tuple(range(L)), device_layer_num=L, page_size=P,
        kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE, kv_cache_dim=KV_LORA + ROPE, dtype=torch.bfloat16, device=CPU,
    )  # fmt: skip
    with base.host_memory_budget_scope(1 << 30):
        return MLATokenToKVPoolHost(
            info, 2.0, 0, P, "page_first_kv_split", pin_memory=pin_memory, device_capacity_tokens=P * 8,
            start_layer=0, end_layer=L, target_layer_num=L, host_token_capacity=P * PAGES,
        )  # fmt: skip


@pytest.mark.parametrize("unregister", ["theirs", "drop-in"])
def test_mla_page_first_kv_split_destroy_releases_only_k(
    fake: Any, monkeypatch: pytest.MonkeyPatch, unregister: str
) -> None:
    """MLA's Ascend layout allocates K and V (RoPE) buffers apart; ``destroy()`` unregisters only
    ``kv_buffer`` (= ``k_buffer``). With their own ``_cuda_host_register`` the V buffer stays
    registered after ``destroy()`` exactly as with the drop-in: an SGLang gap, not pinpool's.
    The adopter releases ``v_buffer`` itself."""
    shim = load_shim("sglang_host_register", fake)
    their_unregister = common._cuda_host_unregister
    monkeypatch.setattr(base, "_is_cuda", True)
    monkeypatch.delitem(common.ALLOC_MEMORY_FUNCS, "cpu", raising=False)
    if unregister == "drop-in":
        _install(monkeypatch, shim, "register")
    plain, pinned = _kv_split(False), _kv_split(True)
    for name in ("k_buffer", "v_buffer"):
        a, b = getattr(pinned, name), getattr(plain, name)
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
    assert [(r.shape, r.stride()) for r in pinned.data_refs] == [(r.shape, r.stride()) for r in plain.data_refs]
    v = pinned.v_buffer
    assert set(fake.registered) == {pinned.k_buffer.data_ptr(), v.data_ptr()}
    pinned.destroy()
    pinned.destroy()
    assert fake.registered == {v.data_ptr(): v.numel() * v.element_size()}  # K released, V still registered
    (their_unregister if unregister == "theirs" else shim._cuda_host_unregister)(v)
    if unregister == "drop-in":  # their destroy() released K under pinpool: close it now (713 -> released)
        shim._cuda_host_unregister(pinned.k_buffer)
        assert pinned.k_buffer._pinpool_pool.state == pinpool.PoolState.CLOSED
    plain.destroy()
