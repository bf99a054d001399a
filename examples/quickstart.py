"""Pin a host-memory pool, write into it, unpin it: the README's example as a program.

    python examples/quickstart.py                                  # 1 GiB, the best runtime here
    python examples/quickstart.py --size 256MiB --runtime mlock    # real page-locking without a GPU

``--runtime auto`` picks CUDA (``cudaHostRegister``) where torch sees a GPU, else ``mlock``.
Under mlock the pool is charged to RLIMIT_MEMLOCK: run as root, or raise ``ulimit -l``.
"""

from __future__ import annotations

import argparse

import anyio

import pinpool
from pinpool import layouts

MiB = 1 << 20


def vm_locked_bytes() -> int:
    """What the kernel says this process has locked (VmLck): mlock shows here, CUDA pinning does not."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return 0


async def main(size: str, runtime: str) -> None:
    before = vm_locked_bytes()
    pool = pinpool.PinnedPool(
        layout=layouts.Raw(granularity_bytes=2 * MiB),  # chunk boundaries on 2 MiB copy pages
        size=size,
        runtime=runtime,
        chunk_bytes="256MiB",  # one registration call per 256 MiB (without it, pinpool decides)
        name="quickstart",
    )
    # The constructor planned everything and validated every option; nothing is mapped yet.
    print(f"plan:   {pool!r}")

    async with pool:  # maps the memory and pins it on worker threads; the event loop keeps running
        host = pool.tensor  # torch.uint8, shape (nbytes,): a zero-copy view of the pinned memory
        host.fill_(7)  # pinned memory is ordinary memory to torch: write all of it
        assert int(host[::4096].sum()) == 7 * len(host[::4096])
        pinned = vm_locked_bytes()
        print(
            f"pinned: {pool.pinned_bytes} bytes ({pool.pinned_bytes / MiB:.0f} MiB) "
            f"in {len(pool.plan.chunks)} chunk(s) "
            f"with runtime {pool.runtime.name!r} in {pool.stats.pin_seconds:.3f} s"
        )
        for chunk in pool.plan.chunks:  # one registration call each; offsets are multiples of 2 MiB
            print(f"  chunk at +{chunk.offset / MiB:.0f} MiB, {chunk.nbytes / MiB:.0f} MiB")
        print(f"wrote:  {host.numel()} bytes through pool.tensor")
    # Leaving the block unregistered every chunk, whatever happened inside it.
    after = vm_locked_bytes()
    print(f"unpinned in {pool.stats.unpin_seconds:.3f} s; pool.pinned_bytes is now {pool.pinned_bytes}")
    print(f"VmLck:  before={before} pinned={pinned} after={after} (bytes)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="pool size, e.g. 256MiB or 64GiB (default: 1GiB)")
    parser.add_argument("--runtime", default="auto", help="auto, cuda, rocm or mlock (default: auto)")
    args = parser.parse_args()
    anyio.run(main, args.size, args.runtime)  # or asyncio.run(main(...)); trio: see trio_pool.py
