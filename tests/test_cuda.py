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
        assert pool.runtime.name == "cuda" and len(pool.chunks) == 4
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
        runtime.unregister(pool.chunks[0].offset + 4096)
    assert info.value.code in (1, 713)


def test_auto_picks_cuda_here() -> None:
    with pinpool.PinnedPool(size=4 * MiB) as pool:
        assert pool.runtime.name == "cuda"
