"""SGLang 0.5.23's own registration and destroy path on the drop-in, both teardown orders."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import load_shim

import pinpool

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


G = 3 << 19  # 1.5 MiB: a granularity that is not a power of two
UNITS = 40


@pytest.mark.parametrize("rc", [1, 2])
@pytest.mark.parametrize("cap", [8 << 20, G], ids=["refuse-above-8MiB", "refuse-above-one-unit"])
def test_their_degradation_contract_with_the_drop_in_register(
    fake: Any, monkeypatch: pytest.MonkeyPatch, rc: int, cap: int
) -> None:
    """SGLang's own chunk-degradation scenario on their allocation path (alloc_with_host_register
    -> the drop-in _cuda_host_register): a driver refusing registrations above ``cap`` with rc."""
    shim = load_shim("sglang_host_register", fake)
    monkeypatch.setattr(common, "_cuda_host_register", shim._cuda_host_register)
    fake.refuse_above(cap, rc=rc)
    dims = (UNITS, G // 2)  # one row of bf16 is one unit
    buffer = common.alloc_with_host_register(
        dims, torch.bfloat16, "cpu", True, common.HostTensorAllocator(), registration_granularity_bytes=G
    )
    try:
        ranges = sorted(fake.registered.items())
        base, total = buffer.data_ptr(), UNITS * G
        # contiguous, whole units, under the cap, the buffer covered exactly
        assert [p for p, _ in ranges] == [base + sum(n for _, n in ranges[:i]) for i in range(len(ranges))]
        assert sum(n for _, n in ranges) == total
        assert all(n % G == 0 and n <= cap for _, n in ranges)
        assert all(n >= G and n % G == 0 for op, _, n, _ in fake.calls if op == "register")  # never below a unit
        if cap == G:
            assert len(ranges) == UNITS
        assert sorted(buffer._sglang_cuda_host_registered_ranges) == ranges
    finally:
        shim._cuda_host_unregister(buffer)


@pytest.mark.parametrize("rc", [1, 2])
def test_a_unit_their_driver_refuses_fails_after_one_call_with_nothing_left(
    fake: Any, monkeypatch: pytest.MonkeyPatch, rc: int
) -> None:
    """Below one unit SGLang's contract never splits: one call for the unit, then PinError, rolled back."""
    shim = load_shim("sglang_host_register", fake)
    monkeypatch.setattr(common, "_cuda_host_register", shim._cuda_host_register)
    fake.refuse_above(G - 4096, rc=rc)
    with pytest.raises(pinpool.PinError):
        common.alloc_with_host_register(
            (UNITS, G // 2), torch.bfloat16, "cpu", True, common.HostTensorAllocator(), registration_granularity_bytes=G
        )
    registers = [(p, n) for op, p, n, _ in fake.calls if op == "register"]
    assert all(n >= G and n % G == 0 for _, n in registers)
    assert [n for _, n in registers].count(G) == 1  # the first unit, tried once
    assert fake.registered == {}
