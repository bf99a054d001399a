"""A server's host KV-cache pool, set up in a synchronous ``__init__``, as SGLang's host pools are.

    python examples/sync_init.py                                  # 1 GiB, the best runtime here
    python examples/sync_init.py --size 256MiB --runtime mlock

Servers often build their host memory pool in a plain constructor, with no event loop around:
``HostKVPool.__init__`` pins the pool with ``with`` semantics through a
``contextlib.ExitStack``, keeps it open past ``__init__``, and ``close()`` unpins it. If
anything in ``__init__`` fails after the pool is pinned, the stack unpins it before the
exception leaves the constructor, so a failed start never leaves memory pinned.
examples/test_with_fake_runtime.py tests this class's failure paths.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from prometheus_client import REGISTRY, CollectorRegistry

import pinpool
from pinpool import layouts
from pinpool.runtimes import Runtime

MiB = 1 << 20


class HostKVPool:
    """K and V for ``layer_num`` layers, ``page_size`` tokens a page, in one pinned host pool.

    ``runtime``, ``chunk_bytes``, ``registry`` and any other ``pool_options`` are passed to the
    pool, so tests can hand in a ``pinpool.testing.FakeRuntime``, small chunks, a registry of
    their own and ``max_retries=0`` (a plain failure, no retry). ``on_pinned(pool)`` runs once
    the pool is pinned: a server would register the buffer with its transfer engine there.
    """

    def __init__(
        self,
        *,
        size: int | str,
        layer_num: int = 4,
        page_size: int = 16,
        head_num: int = 4,
        head_dim: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        runtime: str | Runtime = "auto",
        chunk_bytes: int | str | None = None,
        registry: CollectorRegistry | None = REGISTRY,
        on_pinned: Callable[[pinpool.PinnedPool], None] | None = None,
        **pool_options: Any,
    ) -> None:
        layout = layouts.MHA(
            "page_first", layer_num=layer_num, page_size=page_size, head_num=head_num, head_dim=head_dim, dtype=dtype
        )
        self.page_size = page_size
        with contextlib.ExitStack() as stack:
            # Entering pins the pool (blocking this thread until it is done); if pinning fails
            # or is interrupted, pinpool has rolled it back before the exception gets here.
            self.pool = stack.enter_context(
                pinpool.PinnedPool(
                    layout=layout,
                    size=size,
                    runtime=runtime,
                    chunk_bytes=chunk_bytes,
                    registry=registry,
                    name="host-kv",
                    **pool_options,
                )
            )
            self.kv = self.pool.tensors["kv"]  # (2, tokens, layer_num, head_num, head_dim): K is 0, V is 1
            self.num_pages = self.pool.num_pages
            if on_pinned is not None:
                on_pinned(self.pool)  # if this raises, the `with` above unpins the pool
            # Everything worked: take the pool out of the stack so it stays pinned past __init__.
            self._resources = stack.pop_all()

    def page(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one page: each (page_size, layer_num, head_num, head_dim), contiguous."""
        tokens = slice(index * self.page_size, (index + 1) * self.page_size)
        return self.kv[0, tokens], self.kv[1, tokens]

    def close(self) -> None:
        """Unpin the pool (raises pinpool.UnpinError if a chunk could not be unregistered). Idempotent."""
        self._resources.close()

    def __enter__(self) -> HostKVPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def vm_locked_bytes() -> int:
    """What the kernel says this process has locked (VmLck): mlock shows here, CUDA pinning does not."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return 0


def main(size: str, runtime: str) -> None:
    before = vm_locked_bytes()
    host = HostKVPool(size=size, runtime=runtime)  # returns once the pool is pinned
    try:
        pool = host.pool
        pinned = vm_locked_bytes()
        print(
            f"pinned: {pool.pinned_bytes} bytes ({pool.pinned_bytes / MiB:.0f} MiB) "
            f"in {len(pool.plan.chunks)} chunk(s) "
            f"with runtime {pool.runtime.name!r} in {pool.stats.pin_seconds:.3f} s"
        )
        print(
            f"layout: {pool.layout.name}, {host.num_pages} pages of {pool.plan.page_bytes} bytes, "
            f"kv {tuple(host.kv.shape)}"
        )
        k, v = host.page(host.num_pages - 1)  # write the last page, read it back
        k.fill_(1.5)
        v.fill_(-2.0)
        assert float(host.kv[0, -1].mean()) == 1.5 and float(host.kv[1, -1].mean()) == -2.0
        print(f"wrote:  page {host.num_pages - 1}: K and V, {k.numel() * k.element_size()} bytes each")
    finally:
        host.close()  # a server calls this on shutdown
    after = vm_locked_bytes()
    print(f"closed: pool.pinned_bytes is now {pool.pinned_bytes}")
    print(f"VmLck:  before={before} pinned={pinned} after={after} (bytes)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A synchronous server init that pins a host KV pool.")
    parser.add_argument("--size", default="1GiB", help="pool size, e.g. 256MiB or 64GiB (default: 1GiB)")
    parser.add_argument("--runtime", default="auto", help="auto, cuda, rocm or mlock (default: auto)")
    args = parser.parse_args()
    main(args.size, args.runtime)
