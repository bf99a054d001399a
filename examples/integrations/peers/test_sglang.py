"""SGLang 0.5.23's own registration and destroy path on the drop-in, both teardown orders."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import load_shim

common = pytest.importorskip("sglang.srt.mem_cache.pool_host.common")
from sglang.srt.mem_cache.storage.mmap import alloc_mmap  # noqa: E402

DIMS = (2, 1025 * 16, 4, 4, 64)  # page_first, page_num 1025, P=16
G = 16 * 4 * 4 * 64 * 2


@pytest.mark.parametrize("order", ["sglang-first", "pinpool-first"])
def test_their_unregister_and_pinpools_close_in_either_order(fake: Any, order: str) -> None:
    shim = load_shim("sglang_host_register", fake)
    buffer = alloc_mmap(DIMS, torch.bfloat16)
    plain = buffer.clone()
    shim._cuda_host_register(buffer, G)
    assert torch.equal(buffer, plain) and buffer.shape == plain.shape and buffer.stride() == plain.stride()
    assert sorted(fake.registered.items()) == sorted(buffer._sglang_cuda_host_registered_ranges)
    if order == "sglang-first":
        common._cuda_host_unregister(buffer)  # their destroy() path: the recorded ranges
        shim._cuda_host_unregister(buffer)  # pinpool: released elsewhere, no UnpinError
    else:
        shim._cuda_host_unregister(buffer)
        common._cuda_host_unregister(buffer)  # finds the record emptied: nothing to do
