"""FakeCudart, the public stand-in for ``torch.cuda.cudart()``: CUDA's registration books (712,
713, the per-thread sticky error), real page locks, fault injection; and ``from_binding``, the
public way to build CudaRuntime and RocmRuntime on it."""

from __future__ import annotations

import ctypes
import mmap
import re
import threading
from collections.abc import Iterator

import pytest

import pinpool
from pinpool.runtimes import SHARED_PAGES, CudaRuntime, RocmRuntime
from pinpool.testing import FakeCudart, locked_bytes

from ..conftest import needs_mlock

PAGE = mmap.PAGESIZE
MiB = 1 << 20


def vmlck_kb() -> int:
    return locked_bytes() // 1024


@pytest.fixture
def memory() -> Iterator[int]:
    """The address of 16 pages of this process's memory, faulted in."""
    buf = mmap.mmap(-1, 16 * PAGE)
    buf.write(b"\1" * len(buf))
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    yield address
    buf.close()


@pytest.mark.parametrize(("platform", "already", "missing"), [("cuda", 712, 713), ("rocm", 1061, 1062)])
def test_books_by_exact_byte_range(memory: int, platform: str, already: int, missing: int) -> None:
    fake = FakeCudart(platform=platform)
    mid = memory + PAGE + 100  # two registrations share the page around the cut: both succeed
    assert fake.cudaHostRegister(memory, mid - memory, 0) == 0
    assert fake.cudaHostRegister(mid, 2 * PAGE, 0) == 0
    assert fake.cudaHostRegister(mid - 1, 2, 0) == already  # one byte in each
    assert fake.cudaGetLastError() == already and fake.cudaGetLastError() == 0  # returned, then cleared
    assert fake.cudaHostUnregister(mid + 1) == missing  # not a base
    assert fake.cudaHostUnregister(memory) == 0
    assert fake.cudaHostUnregister(memory) == missing  # not any more
    assert fake.registered == {mid: 2 * PAGE}
    assert fake.calls == [
        ("register", memory, mid - memory, 0), ("register", mid, 2 * PAGE, 0),
        ("register", mid - 1, 2, already), ("unregister", mid + 1, 0, missing),
        ("unregister", memory, mid - memory, 0), ("unregister", memory, 0, missing),
    ]  # fmt: skip
    assert fake.cudaHostRegister(memory, 0, 0) == 1  # a size of 0 is cudaErrorInvalidValue
    assert (
        fake.cudaGetErrorString(fake.cudaError(missing)) == "pointer does not correspond to a registered memory region"
    )


@needs_mlock
def test_lock_really_locks_and_counts_shared_pages(memory: int) -> None:
    before = vmlck_kb()
    fake = FakeCudart()
    cut = memory + 4 * PAGE + 8  # the page at memory + 4 * PAGE is shared by both registrations
    assert fake.cudaHostRegister(memory, cut - memory, 0) == 0
    assert fake.cudaHostRegister(cut, 4 * PAGE, 0) == 0
    assert vmlck_kb() - before == 9 * PAGE // 1024
    assert SHARED_PAGES.holders(memory + 4 * PAGE) == 2
    assert fake.cudaHostUnregister(memory) == 0  # the neighbour still needs the shared page
    assert SHARED_PAGES.holders(memory + 4 * PAGE) == 1
    assert vmlck_kb() - before == 5 * PAGE // 1024
    assert fake.cudaHostUnregister(cut) == 0
    assert vmlck_kb() == before and fake.registered == {}


def test_lock_false_keeps_books_only() -> None:
    before = vmlck_kb()
    fake = FakeCudart(lock=False)
    assert fake.cudaHostRegister(0x10_0000, 64 * MiB, 0) == 0  # not this process's memory: books only
    assert vmlck_kb() == before and fake.registered == {0x10_0000: 64 * MiB}
    assert fake.cudaHostUnregister(0x10_0000) == 0


def test_sticky_error_is_per_thread() -> None:
    fake = FakeCudart(lock=False)
    seen: list[int] = []

    def other() -> None:
        assert fake.cudaHostUnregister(0x5000) == 713
        seen.append(fake.cudaGetLastError())

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [713] and fake.cudaGetLastError() == 0  # this thread never failed


def test_refuse_above_and_fail() -> None:
    fake = FakeCudart(lock=False)
    fake.refuse_above(8 * MiB)  # rc=1 by default, as SGLang's production driver
    assert fake.cudaHostRegister(0x100_0000, 8 * MiB, 0) == 0
    assert fake.cudaHostRegister(0x200_0000, 8 * MiB + 1, 0) == 1
    fake.refuse_above(8 * MiB, rc=2)
    assert fake.cudaHostRegister(0x200_0000, 16 * MiB, 0) == 2
    fake.fail("register", 999, times=2, when=lambda ptr, nbytes: ptr >= 0x400_0000)
    assert fake.cudaHostRegister(0x300_0000, MiB, 0) == 0  # the predicate is false: not counted
    assert fake.cudaHostRegister(0x400_0000, MiB, 0) == 999
    assert fake.cudaHostRegister(0x400_0000, MiB, 0) == 999
    assert fake.cudaHostRegister(0x400_0000, MiB, 0) == 0  # two times, then it is spent
    fake.fail("unregister", 2, when=lambda ptr, nbytes: nbytes == MiB)  # nbytes: the registration's size
    assert fake.cudaHostUnregister(0x100_0000) == 0  # 8 MiB: not this one
    assert fake.cudaHostUnregister(0x300_0000) == 2
    assert 0x300_0000 in fake.registered  # a failed unregister leaves it registered
    assert fake.cudaHostUnregister(0x300_0000) == 0
    assert fake.cudaGetErrorName(2) == b"cudaErrorMemoryAllocation"
    assert fake.cudaGetErrorName(4242) == b"unrecognized error code"
    assert FakeCudart(platform="rocm").hipGetErrorName(1062) == b"hipErrorHostMemoryNotRegistered"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: FakeCudart(platform="xpu"), "platform='xpu' is not one of 'cuda', 'rocm'"),
        (lambda: FakeCudart(lock=1), "lock=1 must be True"),  # type: ignore[arg-type]
        (lambda: FakeCudart().fail("populate", 2), "op='populate' is not a FakeCudart call"),
        (lambda: FakeCudart().fail("register", 0), "rc=0 must be a positive int"),
        (lambda: FakeCudart().fail("register", 2, times=0), "times=0 must be an int of at least 1"),
        (lambda: FakeCudart().fail("register", 2, when=3), "when=3 must be None or a callable"),  # type: ignore[arg-type]
        (lambda: FakeCudart().refuse_above(-1), "nbytes=-1 must be an int of at least 0"),
    ],
)  # fmt: skip
def test_bad_arguments_are_config_errors(call: object, match: str) -> None:
    with pytest.raises(pinpool.ConfigError, match=re.escape(match)):
        call()  # type: ignore[operator]


def test_calls_from_many_threads_are_all_booked() -> None:
    fake = FakeCudart(lock=False)

    def work(base: int) -> None:
        for i in range(200):
            assert fake.cudaHostRegister(base + i * 4096, 4096, 0) == 0

    threads = [threading.Thread(target=work, args=(0x1000_0000 * (k + 1),)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(fake.registered) == 800 and len(fake.calls) == 800


# -- from_binding -------------------------------------------------------------------------------


@pytest.mark.parametrize(("cls", "platform"), [(CudaRuntime, "cuda"), (RocmRuntime, "rocm")])
def test_from_binding_runs_the_real_runtime_code(memory: int, cls: type[CudaRuntime], platform: str) -> None:
    fake = FakeCudart(platform=platform)
    runtime = cls.from_binding(fake, device=1, flags=2)
    assert runtime.clears_sticky_errors and (runtime.device, runtime.flags) == (1, 2)
    runtime.register(memory, PAGE)
    with pytest.raises(pinpool.RuntimeCallError) as info:
        runtime.register(memory, PAGE)
    assert info.value.reason.endswith("HostMemoryAlreadyRegistered") and "(device 1)" in info.value.message
    assert fake.cudaGetLastError() == 0  # the runtime cleared the sticky error in this thread
    with pytest.raises(pinpool.RuntimeCallError) as info:
        runtime.unregister(memory + 1)
    assert info.value.reason.endswith("HostMemoryNotRegistered")
    assert fake.cudaGetLastError() == 0
    runtime.unregister(memory)
    assert fake.registered == {}


def test_from_binding_with_a_library_and_without_one() -> None:
    fake = FakeCudart(lock=False)
    calls = ("cudaHostRegister", "cudaHostUnregister", "cudaGetErrorString", "cudaError")
    plain = type("TorchShaped", (), {name: staticmethod(getattr(fake, name)) for name in calls})()
    runtime = CudaRuntime.from_binding(plain)  # torch's binding has no cudaGetLastError: nothing clears
    assert not runtime.clears_sticky_errors
    with pytest.raises(pinpool.RuntimeCallError):
        runtime.unregister(0x1000)
    assert fake.cudaGetLastError() == 713  # left pending, as on a host where libcudart was not found
    runtime = CudaRuntime.from_binding(plain, library=fake)
    with pytest.raises(pinpool.RuntimeCallError) as info:
        runtime.unregister(0x1000)
    assert info.value.reason == "cudaErrorHostMemoryNotRegistered" and fake.cudaGetLastError() == 0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: CudaRuntime.from_binding(FakeCudart(platform="rocm")), "platform='rocm', whose error codes differ"),
        (lambda: RocmRuntime.from_binding(FakeCudart()), "platform='cuda'"),
        (lambda: CudaRuntime.from_binding(object()), "has no callable cudaHostRegister"),  # type: ignore[arg-type]
        (lambda: CudaRuntime.from_binding(FakeCudart(), device=-1), "device=-1 must be a non-negative"),
        (lambda: CudaRuntime.from_binding(FakeCudart(), flags=-1), "flags=-1 must be a non-negative int"),
    ],
)  # fmt: skip
def test_from_binding_checks_its_arguments(call: object, match: str) -> None:
    with pytest.raises(pinpool.ConfigError, match=re.escape(match)):
        call()  # type: ignore[operator]


@needs_mlock
def test_a_pool_on_the_fake_is_really_locked_and_fully_released() -> None:
    fake = FakeCudart()
    before = vmlck_kb()
    with pinpool.PinnedPool(size=32 * MiB, chunk_bytes=8 * MiB, runtime=CudaRuntime.from_binding(fake)) as pool:
        assert pool.runtime.name == "cuda" and len(fake.registered) == 4
        assert vmlck_kb() - before == 32 * MiB // 1024
    assert fake.registered == {} and vmlck_kb() == before
