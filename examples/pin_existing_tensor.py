"""Pin a tensor you allocated yourself with ``pinpool.pin``, and unpin it without freeing it.

    python examples/pin_existing_tensor.py                                  # 1 GiB, the best runtime here
    python examples/pin_existing_tensor.py --size 256MiB --runtime mlock

``pinpool.pin(t)`` gives a tensor you own the pool's chunking, worker threads, rollback and
teardown; on exit it unregisters every chunk and leaves your tensor (and its data) as it was.
Two cases, because where the memory starts matters:

1. ``torch.empty``: torch's CPU allocator returns memory 64 bytes into an OS page, not at its
   start. Without a granularity that is fine: the first chunk ends at the first page boundary
   and the rest follow, so no two chunks share a page.
2. A KV cache copied in whole pages of ``page_bytes``: with ``granularity_bytes=`` every chunk
   boundary is a multiple of the granularity from the tensor's start. From a start 64 bytes
   into a page, such a boundary never lands on an OS page boundary, so neighbouring chunks
   share their boundary page: fine where the runtime tracks exact byte ranges (CUDA; mlock,
   which counts the holders of a shared page), refused with ``ConfigError`` elsewhere (ROCm).
   Allocating it page-aligned avoids the question: ``pinpool.empty(...)`` does that (an
   anonymous ``mmap`` viewed as a tensor, as this example does by hand), and then no two
   chunks share a page on any runtime.
"""

from __future__ import annotations

import argparse
import mmap

import torch

import pinpool

MiB = 1 << 20
PAGE = mmap.PAGESIZE


def vm_locked_bytes() -> int:
    """What the kernel says this process has locked (VmLck): mlock shows here, CUDA pinning does not."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return 0


def report(what: str, tensor: torch.Tensor, pinned: pinpool.PinnedPool, locked: int) -> None:
    print(
        f"{what}: pinned {pinned.pinned_bytes} bytes in {len(pinned.plan.chunks)} chunk(s) with runtime "
        f"{pinned.runtime.name!r}; the tensor starts {tensor.data_ptr() % PAGE} B into an OS page; "
        f"granularity {pinned.plan.granularity}; VmLck +{locked} bytes"
    )


def pin_torch_empty(nbytes: int, runtime: str) -> None:
    """Case 1: memory from torch's allocator, no granularity."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    t[::PAGE] = 42  # your data: pinning and pre-faulting leave it as it is
    before = vm_locked_bytes()
    with pinpool.pin(t, runtime=runtime, chunk_bytes=nbytes // 4, name="torch-empty") as pinned:
        assert pinned.tensor.data_ptr() == t.data_ptr()  # the same memory, not a copy
        report("torch.empty", t, pinned, vm_locked_bytes() - before)
    assert int(t[::PAGE].min()) == 42  # unpinned, still yours, data intact
    print(f"torch.empty: unpinned, tensor kept; VmLck back to +{vm_locked_bytes() - before} bytes")


def pin_page_aligned_kv(nbytes: int, runtime: str) -> None:
    """Case 2: a page-aligned KV buffer, pinned with its copy page as the granularity."""
    layer_num, page_bytes = 4, 16 * 1024  # one copy page: page_bytes for each of layer_num layers
    num_pages = nbytes // (layer_num * page_bytes)
    buffer = mmap.mmap(-1, num_pages * layer_num * page_bytes)  # anonymous, page-aligned, zeroed
    kv = torch.frombuffer(buffer, dtype=torch.uint8).view(num_pages, layer_num, page_bytes)
    before = vm_locked_bytes()
    with pinpool.pin(
        kv, granularity_bytes=layer_num * page_bytes, runtime=runtime, chunk_bytes=nbytes // 4, name="kv"
    ) as pinned:
        assert pinned.tensor.shape == kv.shape and pinned.tensor.data_ptr() == kv.data_ptr()
        assert all(chunk.offset % (layer_num * page_bytes) == 0 for chunk in pinned.plan.chunks)  # whole copy pages
        kv[-1].fill_(7)  # use it while pinned
        report("page-aligned kv", kv, pinned, vm_locked_bytes() - before)
    print(f"page-aligned kv: unpinned, tensor kept; VmLck back to +{vm_locked_bytes() - before} bytes")
    del kv  # the mmap can be closed once no tensor uses it
    buffer.close()


def main(size: str, runtime: str) -> None:
    nbytes = pinpool.parse_size(size)
    baseline = vm_locked_bytes()
    pin_torch_empty(nbytes, runtime)
    pin_page_aligned_kv(nbytes, runtime)
    print(f"VmLck:  before={baseline} after={vm_locked_bytes()} (bytes)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Pin tensors you allocated with pinpool.pin.")
    parser.add_argument("--size", default="1GiB", help="tensor size, e.g. 256MiB or 64GiB (default: 1GiB)")
    parser.add_argument("--runtime", default="auto", help="auto, cuda, rocm or mlock (default: auto)")
    args = parser.parse_args()
    main(args.size, args.runtime)
