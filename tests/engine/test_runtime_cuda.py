"""CudaRuntime on a real GPU. Skipped cleanly where torch sees no CUDA device."""

from __future__ import annotations

import pytest
import torch

import pinpool
from pinpool.runtimes import CudaRuntime

MiB = 1 << 20

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
]


def test_pool_is_cuda_pinned_and_copies_round_trip() -> None:
    runtime = CudaRuntime()
    with pinpool.PinnedPool(size=256 * MiB, chunk_bytes=64 * MiB, runtime=runtime, register_workers=2) as pool:
        assert pool.runtime.name == "cuda" and len(pool.plan.chunks) == 4
        assert pool.tensor.is_pinned()
        pool.tensor[: 16 * MiB].fill_(7)
        device = pool.tensor[: 16 * MiB].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert int(device.sum().item()) == 7 * 16 * MiB


def test_double_registration_is_named_and_not_sticky() -> None:
    runtime = CudaRuntime()
    with pinpool.PinnedPool(size=8 * MiB, runtime=runtime) as pool:
        with pytest.raises(pinpool.RuntimeCallError) as info:
            runtime.register(pool.data_ptr, 8 * MiB)
        assert info.value.code == 712
        assert info.value.reason == "cudaErrorHostMemoryAlreadyRegistered"
        torch.zeros(1, device="cuda").add_(1)  # the failed call's error must not leak into this one
        torch.cuda.synchronize()
    with pytest.raises(pinpool.RuntimeCallError) as info:
        runtime.unregister(pool.plan.chunks[0].offset + 4096)
    assert info.value.code in (1, 713)


def test_auto_picks_cuda_here() -> None:
    with pinpool.PinnedPool(size=4 * MiB) as pool:
        assert pool.runtime.name == "cuda"


@pytest.mark.parametrize("huge_pages", [False, True])
def test_default_pipeline_faults_ahead_and_registers_every_chunk(huge_pages: bool) -> None:
    """CUDA's order: populate workers fault spans ahead, one register worker registers whole chunks."""
    pool = pinpool.PinnedPool(size=512 * MiB, chunk_bytes=64 * MiB, runtime=CudaRuntime(), huge_pages=huge_pages)
    assert pool.plan.order.value == "populate_first" and pool.plan.register_workers == 1 and pool.plan.populate
    with pool:
        for chunk in pool.plan.chunks:
            assert pool.tensor[chunk.offset : chunk.offset + chunk.nbytes].is_pinned()
        pool.tensor[-MiB:].fill_(3)
        device = pool.tensor[-MiB:].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert int(device.sum().item()) == 3 * MiB
    assert pool.pinned_bytes == 0


def test_parallel_teardown_unregisters_every_chunk() -> None:
    pool = pinpool.PinnedPool(size=256 * MiB, chunk_bytes=16 * MiB, runtime=CudaRuntime(), unpin_workers=4)
    with pool:
        kept = pool.tensor  # a view outlives the pool (it keeps the memory mapped), merely unpinned
        assert kept.is_pinned()
    assert pool.plan.unpin_workers == 4 and pool.pinned_bytes == 0
    for chunk in pool.plan.chunks:  # every chunk was unregistered by one of the unpin workers
        assert not kept[chunk.offset : chunk.offset + chunk.nbytes].is_pinned()


def test_an_elastic_pool_grows_and_shrinks_with_cuda() -> None:
    """Each segment is its own cudaHostRegister calls: pinned once grown, copied to the GPU and back, and no longer
    pinned once given back, while the floor stays pinned and copies on."""
    pool = pinpool.PinnedPool(
        size=64 * MiB, reserve=256 * MiB, grow_step=64 * MiB, chunk_bytes=32 * MiB, runtime=CudaRuntime()
    )
    with pool:
        floor = pool.tensor[: 64 * MiB]
        assert floor.is_pinned() and not pool.tensor[64 * MiB : 128 * MiB].is_pinned()
        (grown,) = pool.grow_sync(nbytes=64 * MiB).pages
        segment = pool.tensor[grown.start : grown.stop]
        assert segment.is_pinned() and pool.pinned_bytes == 128 * MiB
        segment.fill_(5)
        back = segment.to("cuda", non_blocking=True).add_(1).to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        assert int(back.sum().item()) == 6 * len(grown)
        pool.shrink_sync(to_pages=grown.start)
        assert not segment.is_pinned() and floor.is_pinned() and pool.pinned_bytes == 64 * MiB
        assert int(segment.count_nonzero().item()) == 0  # given back
        floor.fill_(2)
        assert int(floor.to("cuda", non_blocking=True).sum().item()) == 2 * 64 * MiB
    assert pool.pinned_bytes == 0
