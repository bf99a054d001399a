"""SGLang's HiCache MHA host pool (``mem_cache/pool_host/``) with its memory pinned by pinpool.

    python examples/integrations/sglang_hicache_host_pool.py                        # 64 MiB, both layouts
    python examples/integrations/sglang_hicache_host_pool.py --size 1GiB --runtime mlock

``MHATokenToKVPoolHost`` below keeps SGLang's shape: its sizing (``page_num = size // page_size
+ 1``, one page more than the budget), its buffer dims per layout, its per-layer K/V views, its
lowest-first slot allocator and an idempotent ``destroy()``. What changes is the memory:
SGLang maps the buffer itself and registers it in granularity-aligned chunks
(``_cuda_host_register`` and its unregister helpers in ``pool_host/common.py``); here one
``pinpool.PinnedPool`` does all of that, in the background, and the allocator hands out only
pages that are pinned already (``pool.pinned_pages``), so the server serves while the pool pins.

docs/integrations.md compares the two; tests/tools/test_integrations.py checks the shapes and strides
against SGLang's own formulas.
"""

from __future__ import annotations

import argparse
import heapq
import logging
import threading
import time

import torch
from prometheus_client import CollectorRegistry

import pinpool
from pinpool import layouts
from pinpool.runtimes import Runtime

logger = logging.getLogger("sglang_hicache_host_pool")
MiB = 1 << 20


class MHATokenToKVPoolHost:
    """K and V of ``layer_num`` layers for ``size`` tokens, in one pinned host buffer, as SGLang lays it out.

    ``host_size_bytes`` is the host budget (SGLang: ``--hicache-size`` GB); ``layout`` is
    ``"layer_first"`` or ``"page_first"`` (pinpool's ``MHA`` layout also has SGLang's
    ``page_first_direct`` and ``page_head``). ``runtime``, ``chunk_bytes``, ``max_call_seconds``
    and ``registry`` go to the pool, so tests can pass a ``pinpool.testing.FakeRuntime``.
    """

    def __init__(
        self,
        *,
        host_size_bytes: int,
        layer_num: int,
        head_num: int,
        head_dim: int,
        page_size: int,
        layout: str,
        dtype: torch.dtype = torch.bfloat16,
        runtime: str | Runtime = "auto",
        chunk_bytes: int | str | None = None,
        max_call_seconds: float | str | None = "auto",
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.layer_num, self.head_num, self.head_dim = layer_num, head_num, head_dim
        self.page_size, self.layout, self.dtype = page_size, layout, dtype
        # SGLang's sizing (HostKVCache.__init__): tokens that fit the budget, then one page more.
        self.size_per_token = head_dim * head_num * layer_num * dtype.itemsize * 2
        self.size = host_size_bytes // self.size_per_token
        self.page_num = self.size // page_size + 1
        self.size = self.page_num * page_size
        self.token_stride_size = head_num * head_dim * dtype.itemsize
        self.layout_dim = self.token_stride_size * layer_num

        # pinpool: the buffer, its registration in copy-page-aligned chunks, in the background.
        self.pool = pinpool.PinnedPool(
            layout=layouts.MHA(layout, layer_num=layer_num, page_size=page_size, head_num=head_num,
                               head_dim=head_dim, dtype=dtype),
            num_pages=self.page_num, runtime=runtime, background=True, chunk_bytes=chunk_bytes,
            max_call_seconds=max_call_seconds, name=f"hicache-{layout}", registry=registry,
        ).open()  # fmt: skip
        self.kv_buffer = self.pool.tensors["kv"]  # layer_first (2, L, size, H, D); page_first (2, size, L, H, D)

        # SGLang's per-layer views (MHATokenToKVPoolHost.__init__): each (size, H, D), strided for page_first.
        if layout == "page_first":
            self.k_data_refs = [self.k_buffer[:, i] for i in range(layer_num)]
            self.v_data_refs = [self.v_buffer[:, i] for i in range(layer_num)]
        else:
            self.k_data_refs = [self.k_buffer[i] for i in range(layer_num)]
            self.v_data_refs = [self.v_buffer[i] for i in range(layer_num)]

        self.lock = threading.RLock()
        self.clear()

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_data_refs[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_data_refs[layer_id]

    def get_data_page(self, index: int) -> torch.Tensor:
        """K and V of the page holding token ``index``, all layers (a strided view)."""
        tokens = slice(index, index + self.page_size)
        return self.kv_buffer[:, tokens] if self.layout == "page_first" else self.kv_buffer[:, :, tokens]

    # -- the slot allocator: SGLang's, lowest page first, gated by what is pinned ---------------

    def clear(self) -> None:
        with self.lock:
            self.free_pages = list(range(self.page_num))  # a heap: the lowest free page first

    def usable_pages(self) -> int:
        """Pages ``[0, k)`` that are pinned now: the allocator never hands out a page at or above k."""
        return self.pool.pinned_pages

    def available_size(self) -> int:
        """Tokens that can be allocated now (free and pinned)."""
        pinned = self.usable_pages()
        with self.lock:
            return sum(1 for page in self.free_pages if page < pinned) * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Token indices of ``need_size // page_size`` free pinned pages, lowest first; None if too few."""
        assert need_size % self.page_size == 0, "The requested size should be a multiple of the page size."
        pinned = self.usable_pages()  # read before taking pages: it only grows while pinning
        with self.lock:
            taken: list[int] = []
            while len(taken) < need_size // self.page_size and self.free_pages and self.free_pages[0] < pinned:
                taken.append(heapq.heappop(self.free_pages))
            if len(taken) < need_size // self.page_size:
                for page in taken:
                    heapq.heappush(self.free_pages, page)
                return None
        pages = torch.tensor(taken, dtype=torch.int64)
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).flatten()

    def free(self, indices: torch.Tensor) -> int:
        with self.lock:
            for page in (indices[:: self.page_size] // self.page_size).tolist():
                heapq.heappush(self.free_pages, page)
        return len(indices)

    def destroy(self) -> None:
        """Unpin and let go of the buffer (SGLang calls it before process exit). Idempotent, never raises."""
        self.k_data_refs = self.v_data_refs = []
        self.kv_buffer = torch.empty(0)
        if (error := self.pool.close(raise_errors=False)) is not None:
            logger.warning("HiCache host pool closed with an error: %s", error)


def vm_locked_bytes() -> int:
    """The kernel's count of this process's locked memory (VmLck): mlock shows here, CUDA pinning does not."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return 0


def run(layout: str, size: int, runtime: str) -> None:
    before = vm_locked_bytes()
    # 4 layers, 4 heads of 64 bf16, 16 tokens a page: 4 KiB a token, 64 KiB a page.
    host = MHATokenToKVPoolHost(
        host_size_bytes=size, layer_num=4, head_num=4, head_dim=64, page_size=16, layout=layout,
        runtime=runtime, chunk_bytes="4MiB",
    )  # fmt: skip
    pool = host.pool
    try:
        print(f"[{layout}] sized: size_per_token={host.size_per_token} B, page_num={host.page_num} "
              f"(= {size} // {host.size_per_token} // {host.page_size} + 1), size={host.size} tokens")  # fmt: skip
        k1 = host.get_key_buffer(1)
        print(f"[{layout}] kv_buffer {tuple(host.kv_buffer.shape)} strides {host.kv_buffer.stride()}; "
              f"layer 1 K view {tuple(k1.shape)} strides {k1.stride()}")  # fmt: skip
        print(f"[{layout}] pool: {pool.nbytes} bytes, granularity {pool.granularity}, {len(pool.chunks)} chunks")
        # Serve while it pins: take pages as they become pinned, never one above pool.pinned_pages.
        taken: list[torch.Tensor] = []
        during = 0  # pages handed out while the pool was still pinning
        while True:
            settled = pool.state is not pinpool.PoolState.PINNING  # then pinned_pages no longer moves
            got = host.alloc(host.page_size)
            if got is None:  # nothing pinned is free (yet): SGLang treats it as "no host room now"
                if settled:
                    break
                time.sleep(0.001)
                continue
            pinned_pages, state = pool.pinned_pages, pool.state
            assert int(got[0]) // host.page_size < pinned_pages  # only pinned pages are handed out
            during += state is pinpool.PoolState.PINNING
            taken.append(got)
        pages = [int(t[0]) // host.page_size for t in taken]
        assert pages == sorted(pages) == list(range(host.page_num))  # lowest first, every page once
        print(f"[{layout}] allocated pages 0..{pages[-1]} lowest first, {during} of them while pinning; "
              "none at or above pool.pinned_pages")  # fmt: skip
        pool.wait_ready_sync(timeout=120)
        pinned = vm_locked_bytes()
        # Write layer 2 of the last page through the per-layer views, read it back through the page view.
        last = taken[-1]
        host.get_key_buffer(2)[last] = 1.5
        host.get_value_buffer(2)[last] = -2.0
        page = host.get_data_page(int(last[0]))
        k_page, v_page = (page[0][:, 2], page[1][:, 2]) if layout == "page_first" else (page[0][2], page[1][2])
        assert float(k_page.mean()) == 1.5 and float(v_page.mean()) == -2.0
        print(f"[{layout}] wrote layer 2 of page {int(last[0]) // host.page_size} through k/v views, read back "
              "through get_data_page")  # fmt: skip
        host.free(torch.cat(taken))
        print(f"[{layout}] freed; available_size={host.available_size()} tokens of {host.size}")
        print(f"[{layout}] pinned: {pool.pinned_bytes} bytes in {len(pool.registrations)} registration(s), runtime "
              f"{pool.runtime.name!r}")  # fmt: skip
    finally:
        host.destroy()
        host.destroy()  # idempotent: a second destroy does nothing
    after = vm_locked_bytes()
    print(f"[{layout}] destroyed twice: state {pool.state.value}, pinned_bytes {pool.pinned_bytes}")
    print(f"VmLck: before={before} pinned={pinned} after={after} (bytes)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="SGLang's HiCache MHA host pool on pinpool.")
    parser.add_argument("--size", default="64MiB", help="host budget per pool, e.g. 64MiB (default)")
    parser.add_argument("--runtime", default="auto", help="auto, cuda, rocm or mlock (default: auto)")
    parser.add_argument("--layout", choices=["page_first", "layer_first", "both"], default="both")
    args = parser.parse_args()
    for name in ["page_first", "layer_first"] if args.layout == "both" else [args.layout]:
        run(name, pinpool.parse_size(args.size), args.runtime)
