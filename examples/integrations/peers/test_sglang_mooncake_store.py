"""SGLang 0.5.23's HiCache Mooncake store (``MooncakeStore``) on the drop-in, with a real Mooncake store.

A ``mooncake_master`` (the binary the Mooncake wheel ships) on 127.0.0.1, their ``MooncakeStore`` set up
against it over TCP (peer-to-peer handshake), their host pool (``MHATokenToKVPoolHost``, ``page_first``,
built on the CPU): ``register_mem_pool_host`` registers the kv_buffer with the store, ``batch_set_v1``
puts pages into the store from it, ``batch_get_v1`` gets them back into it. The drop-in's pool pins
(FakeCudart's books, really mlocked) and registers with the store; the ``fake`` fixture checks nothing
is left pinned. The first test is their gap: their close() leaves the buffer registered."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import load_shim

import pinpool

mooncake_store = pytest.importorskip("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store")
mooncake = pytest.importorskip("mooncake.store")  # the wheel's native libraries load (libibverbs1)
from sglang.srt.mem_cache import device_pool_info as dpi  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host import base  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

MooncakeStore, MooncakeBaseStore = mooncake_store.MooncakeStore, mooncake_store.MooncakeBaseStore
NOT_HELD = -600  # the store's answer to unregister_buffer of an address it does not hold
CPU = torch.device("cpu")
P, L, H, D, PAGES = 16, 4, 4, 64, 64  # page size, layers, heads, head dim, host pages
PAGE_BYTES = L * P * H * D * 2  # one page's K (or V) descriptor in page_first: 32 KiB
MOVED = 24  # pages put and got back


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The wheel's mooncake_master on 127.0.0.1 (its RPC address); stopped after the module."""
    binary = Path(__import__("mooncake").__file__).parent / "mooncake_master"
    port, log = _free_port(), tmp_path_factory.mktemp("mooncake") / "master.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(binary), f"-rpc_port={port}", f"-metrics_port={_free_port()}", "-rpc_address=127.0.0.1"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60  # a readiness wait for the service, not an assertion on time
        while "Master service started" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def store(master: str) -> Iterator[Any]:
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="pinpool/peers",
        extra_config={
            "master_server_address": master, "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp", "device_name": "", "global_segment_size": 64 << 20, "check_server": False,
        },
    )  # fmt: skip
    backend = MooncakeStore(config)
    yield backend
    backend.close()
    backend.store.close()


def _host_pool() -> Any:
    k = tuple(torch.zeros(P * 8, H, D, dtype=torch.bfloat16) for _ in range(L))
    v = tuple(torch.zeros(P * 8, H, D, dtype=torch.bfloat16) for _ in range(L))
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64) for ts in (k, v)]
    buffers = dpi.KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=dpi.KVBufferLayout.NHD)
    info = dpi.MHABufferInfo(
        buffers=buffers, page_size=P, head_num=H, head_dim=D, v_head_dim=D, dtype=torch.bfloat16, device=CPU
    )
    with base.host_memory_budget_scope(1 << 30):  # their pre-flight, without sampling this shared host
        return MHATokenToKVPoolHost(
            info, host_to_device_ratio=2.0, host_size=0, page_size=P, layout="page_first", pin_memory=False,
            device_capacity_tokens=P * 8, start_layer=0, end_layer=L, host_token_capacity=P * PAGES,
        )  # fmt: skip


def _page(host: Any, page: int) -> torch.Tensor:
    return host.get_data_page(page * P, flat=True).clone().view(torch.int16)  # bits: random bf16 has NaNs


def test_their_close_leaves_the_host_buffer_registered(store: Any) -> None:
    host = _host_pool()
    store.register_mem_pool_host(host)  # their register_buffer: one registration of the kv_buffer
    store.close()  # theirs: `pass`
    assert store.store.unregister_buffer(host.kv_buffer.data_ptr()) == 0  # it was still registered
    assert store.store.unregister_buffer(host.kv_buffer.data_ptr()) == NOT_HELD


@pytest.mark.parametrize("max_chunk_bytes", [3 * PAGE_BYTES + 4096, None], ids=["many-registrations", "default"])
def test_pages_move_through_their_store_on_pinpools_registrations_and_close_unregisters(
    fake: Any, store: Any, monkeypatch: pytest.MonkeyPatch, max_chunk_bytes: int | None
) -> None:
    shim = load_shim("sglang_mooncake_store", fake)
    shim.MAX_CHUNK_BYTES = max_chunk_bytes
    monkeypatch.setattr(MooncakeBaseStore, "register_buffer", shim.register_buffer)
    monkeypatch.setattr(MooncakeStore, "close", shim.close)
    host = _host_pool()
    store.register_mem_pool_host(host)
    pools = list(store._pinpool_pools)  # their MHA registers the kv_buffer's K and V halves apart
    kv, total = host.kv_buffer.data_ptr(), host.kv_buffer.nbytes
    assert [p.data_ptr for p in pools] == [kv, kv + total // 2] and sum(fake.registered.values()) == total
    registrations = [(p.data_ptr + r.offset, r) for p in pools for r in p.transfer_registrations("mooncake-store")]
    assert sum(r.nbytes for _, r in registrations) == total
    assert all((a - kv) % PAGE_BYTES == 0 and r.nbytes % PAGE_BYTES == 0 for a, r in registrations)
    if max_chunk_bytes is not None:
        assert len(registrations) == 2 * (PAGES // 3 + 1)  # per half: 3 pages each, the last 1
    noise = torch.randint(0, 256, (total,), dtype=torch.uint8)
    host.kv_buffer.view(-1).view(torch.uint8).copy_(noise)
    written = [_page(host, page) for page in range(MOVED + 1)]
    keys = [f"{max_chunk_bytes}-page-{i}" for i in range(MOVED)]
    assert store.batch_set_v1(keys, torch.arange(MOVED * P)) == [True] * MOVED
    host.kv_buffer.zero_()
    assert store.batch_get_v1(keys, torch.arange(MOVED * P)) == [True] * MOVED
    assert all(torch.equal(_page(host, page), written[page]) for page in range(MOVED))
    assert not torch.equal(_page(host, MOVED), written[MOVED])  # not moved
    store.close()
    assert all(p.state is pinpool.PoolState.CLOSED for p in pools) and store._pinpool_pools == []
    assert all(store.store.unregister_buffer(a) == NOT_HELD for a, _ in registrations)  # the store holds none
