"""SGLang's chunk-degradation scenarios, through pinpool's real CUDA (and ROCm) runtime code.

SGLang's unit tests of chunk degradation (after 0.5.23, sgl-project/sglang#39744) use a cudart
that refuses registrations above 8 MiB with rc=1 (``cudaErrorInvalidValue``, the code seen in
production for a 32 GiB call whose 4 KiB probe at the same pointer succeeded) or rc=2, and
expect: halving in whole granularity units down to one unit, the buffer covered contiguously,
never a call below one unit, and a unit that cannot register failing after one call. Here the
same scenarios run on pinpool's *defaults* (no retry option given), with
:class:`~pinpool.runtimes.CudaRuntime` built on :class:`pinpool.testing.FakeCudart`.
"""

from __future__ import annotations

from typing import Any

import pytest

import pinpool
from pinpool import layouts
from pinpool.runtimes import CudaRuntime, HostRegisterRuntime, RocmRuntime
from pinpool.testing import FakeCudart

from ..conftest import lifecycle_of

KiB, MiB = 1 << 10, 1 << 20
PAGE = 4096
LIMIT = 8 * MiB
ALWAYS = 1 << 30  # FakeCudart.fail(times=ALWAYS): a refusal that lasts the whole test


def refusing(rc: int, limit: int = LIMIT, platform: str = "cuda") -> FakeCudart:
    """``torch.cuda.cudart()`` keeping CUDA's books (no mlock: the books are what is checked),
    refusing every registration above ``limit`` with ``rc``, as SGLang's fake cudart does."""
    binding = FakeCudart(platform=platform, lock=False)
    binding.refuse_above(limit, rc)
    return binding


def register_calls(binding: FakeCudart) -> list[tuple[int, int, int]]:
    """Every register call so far, as (ptr, nbytes, rc)."""
    return [(ptr, nbytes, rc) for op, ptr, nbytes, rc in binding.calls if op == "register"]


def runtime_on(binding: FakeCudart, cls: type[HostRegisterRuntime] = CudaRuntime) -> Any:
    return cls.from_binding(binding)


def pool_of(binding: FakeCudart, *, granularity: int | None, size: int, **kw: Any) -> pinpool.PinnedPool:
    return pinpool.PinnedPool(
        layout=layouts.Raw(granularity_bytes=granularity), size=size, runtime=runtime_on(binding),
        registry=None, populate=False, **kw,
    )  # fmt: skip


def assert_degraded(binding: FakeCudart, pool: pinpool.PinnedPool, base: int, unit: int, size: int) -> None:
    """Every call in whole units from the start, none below one unit, none above the limit
    registered, and the registrations cover ``[0, size)`` contiguously, as pool.registrations says."""
    assert all((ptr - base) % unit == 0 and nbytes >= min(unit, size) for ptr, nbytes, _ in register_calls(binding))
    assert all(nbytes % unit == 0 for ptr, nbytes, _ in register_calls(binding) if ptr + nbytes - base < size)
    ranges = sorted((ptr - base, nbytes) for ptr, nbytes in binding.registered.items())
    assert all(nbytes <= LIMIT for _, nbytes in ranges)
    assert [offset for offset, _ in ranges] == [0, *(o + n for o, n in ranges[:-1])]  # contiguous
    assert ranges[-1][0] + ranges[-1][1] == size
    assert [(c.offset, c.nbytes) for c in pool.registrations] == ranges


@pytest.mark.parametrize("rc", [1, 2], ids=["cudaErrorInvalidValue", "cudaErrorMemoryAllocation"])
@pytest.mark.parametrize("units", [32, 33])  # a power of two, and halves that are not equal
def test_a_registration_above_the_drivers_limit_degrades_in_whole_granularity_units(rc: int, units: int) -> None:
    """SGLang's scenario: one planned call of the whole buffer, refused above 8 MiB; pinpool's
    defaults (with SGLang's limit, max_chunk_bytes=256GiB: one planned call) halve it in whole
    1.5 MiB units until every piece registers."""
    unit = 1536 * KiB  # a copy page that is a whole number of OS pages, not a power of two
    binding = refusing(rc)
    pool = pool_of(binding, granularity=unit, size=units * unit, max_chunk_bytes="256GiB")
    with pool:
        base = pool.data_ptr
        assert_degraded(binding, pool, base, unit, units * unit)
        assert pool.pinned_bytes == units * unit and pool.stats.retries > 0
        refused = [nbytes for _, nbytes, code in register_calls(binding) if code]
        assert refused and all(nbytes > LIMIT and code == rc for _, nbytes, code in register_calls(binding) if code)
    assert binding.registered == {}


@pytest.mark.parametrize("rc", [1, 2])
def test_without_a_granularity_halving_reaches_one_os_page(rc: int) -> None:
    """A driver that takes one page at a time: a 64 KiB buffer ends as 16 page-sized calls."""
    binding = refusing(rc, PAGE)
    pool = pool_of(binding, granularity=None, size=64 * KiB)
    with pool:
        assert_degraded(binding, pool, pool.data_ptr, PAGE, 64 * KiB)
        assert sorted(binding.registered.values()) == [PAGE] * 16
    assert min(nbytes for _, nbytes, _ in register_calls(binding)) == PAGE


@pytest.mark.parametrize("rc", [1, 2])
def test_a_unit_that_cannot_register_fails_with_pin_error_after_one_call(rc: int) -> None:
    """The fifth unit is refused whatever the call's size: halving narrows down to it, calls it
    exactly once at one unit, and the pool fails with PinError, everything rolled back."""
    unit = 2 * MiB
    bad: list[int] = []  # the fifth unit's address: the first call is the whole buffer, at its base

    def refuses(ptr: int, nbytes: int) -> bool:
        bad[:] = bad or [ptr + 4 * unit]
        return ptr <= bad[0] < ptr + nbytes

    binding = FakeCudart(lock=False)
    binding.fail("register", rc, times=ALWAYS, when=refuses)
    pool = pool_of(binding, granularity=unit, size=16 * unit, max_chunk_bytes="256GiB")
    with pytest.raises(pinpool.PinError, match="retries with aligned halves") as info:
        with pool:
            pytest.fail("the body must not run")
    at_the_unit = [
        (ptr, code) for ptr, nbytes, code in register_calls(binding) if ptr <= bad[0] < ptr + nbytes and nbytes == unit
    ]
    assert at_the_unit == [(bad[0], rc)]  # one call for the unit that cannot register
    assert all(nbytes >= unit and nbytes % unit == 0 for _, nbytes, _ in register_calls(binding))
    assert info.value.failures[-1].chunk.nbytes == unit and info.value.code == rc
    assert binding.registered == {} and pool.pinned_bytes == 0


def test_a_unit_above_the_limit_is_called_once_and_never_split_below_a_unit() -> None:
    """A limit smaller than one unit: every call is refused; the first unit-sized piece fails once."""
    unit = 3 * MiB
    binding = refusing(1, 2 * MiB)
    pool = pool_of(binding, granularity=unit, size=8 * unit, max_chunk_bytes="256GiB")
    with pytest.raises(pinpool.PinError):
        with pool:
            pytest.fail("the body must not run")
    assert [nbytes for _, nbytes, _ in register_calls(binding)] == [8 * unit, 4 * unit, 2 * unit, unit]
    assert binding.registered == {}


def test_rocm_retries_hips_codes_for_a_registration_too_large() -> None:
    binding = refusing(1, platform="rocm")  # hipErrorInvalidValue
    pool = pinpool.PinnedPool(
        size=32 * MiB, chunk_bytes="32MiB", runtime=runtime_on(binding, RocmRuntime), registry=None, populate=False
    )
    with pool:
        assert sorted(binding.registered.values()) == [LIMIT] * 4
    assert RocmRuntime.capabilities.retryable_codes == CudaRuntime.capabilities.retryable_codes == {1, 2}


# -- the policy, public: retry_codes, min_chunk_bytes, max_retries ----------------------------------------------


def test_retry_codes_replace_the_runtimes_own() -> None:
    """retry_codes=(2,): CUDA's rc=1 is then a failure at once, after one call; () never retries."""
    for codes in [(2,), ()]:
        binding = refusing(1)
        pool = pool_of(binding, granularity=None, size=32 * MiB, chunk_bytes="32MiB", retry_codes=codes)
        with pytest.raises(pinpool.PinError):
            with pool:
                pytest.fail("the body must not run")
        assert [nbytes for _, nbytes, _ in register_calls(binding)] == [32 * MiB] and pool.stats.retries == 0
    binding = refusing(719)  # a code of the adopter's choosing
    with pool_of(binding, granularity=None, size=32 * MiB, chunk_bytes="32MiB", retry_codes=[719]) as pool:
        assert pool.stats.retries == 3 and sorted(binding.registered.values()) == [LIMIT] * 4


def test_min_chunk_bytes_is_the_floor_of_halving() -> None:
    binding = refusing(2)
    pool = pool_of(binding, granularity=None, size=64 * MiB, chunk_bytes="64MiB", min_chunk_bytes="16MiB")
    with pytest.raises(pinpool.PinError):
        with pool:
            pytest.fail("the body must not run")
    assert [nbytes for _, nbytes, _ in register_calls(binding)] == [64 * MiB, 32 * MiB, 16 * MiB]


def test_max_retries_bounds_the_depth_of_one_chunks_halving_not_the_pool() -> None:
    """Four chunks of 64 MiB each halved three levels (7 retries a chunk, 28 in all) with
    max_retries=3: a bound per chunk lineage; max_retries=2 stops every lineage at 16 MiB."""
    binding = refusing(2)
    with pool_of(binding, granularity=None, size=256 * MiB, chunk_bytes="64MiB", max_retries=3,
                 register_workers=1) as pool:  # fmt: skip
        assert pool.stats.retries == 4 * 7 and sorted(binding.registered.values()) == [LIMIT] * 32
    binding = refusing(2)
    pool = pool_of(binding, granularity=None, size=64 * MiB, chunk_bytes="64MiB", max_retries=2)
    with pytest.raises(pinpool.PinError):
        with pool:
            pytest.fail("the body must not run")
    assert [nbytes for _, nbytes, _ in register_calls(binding)] == [64 * MiB, 32 * MiB, 16 * MiB]


def test_the_default_depth_reaches_one_unit_from_a_256_gib_chunk() -> None:
    """256 GiB halved to 2 MiB units is 17 levels; 4 KiB pages, 26: the default (32) reaches both."""
    assert (256 << 30) // (2 * MiB) == 1 << 17 and (256 << 30) // PAGE == 1 << 26
    assert lifecycle_of(pinpool.PinnedPool(size=MiB, runtime=runtime_on(refusing(2)))).options.max_retries == 32
