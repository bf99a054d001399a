"""The real kernel: MlockRuntime locks pages, and VmLck proves what is locked when."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from collections.abc import Container

import anyio
import pytest

import pinpool
from pinpool._host import libc as _libc
from pinpool.runtimes import MlockRuntime
from pinpool.testing import locked_bytes

from .. import preloaded
from ..conftest import each_driver, hugetlb_pages, needs_mlock, pin_and_run

MiB = 1 << 20

pytestmark = [pytest.mark.anyio, needs_mlock]


class FailingMlock(MlockRuntime):
    """Real mlock, with the register calls numbered in ``fail_on`` (1-based, settable) failing (ENOMEM)."""

    def __init__(self, fail_on: Container[int] = ()) -> None:
        super().__init__()
        self.fail_on = fail_on
        self.calls = 0

    def _maybe_fail(self, ptr: int, nbytes: int) -> None:
        self.calls += 1
        if self.calls in self.fail_on:
            raise pinpool.RuntimeCallError(
                op="mlock", code=12, reason="ENOMEM", message="injected", ptr=ptr, nbytes=nbytes
            )

    def register(self, ptr: int, nbytes: int) -> None:
        self._maybe_fail(ptr, nbytes)
        super().register(ptr, nbytes)

    def lock_on_fault(self, ptr: int, nbytes: int) -> None:
        self._maybe_fail(ptr, nbytes)
        super().lock_on_fault(ptr, nbytes)


@each_driver
async def test_vmlck_grows_by_pool_size_and_returns(mode: str, vmlck_baseline: int) -> None:
    pool = pinpool.PinnedPool(size=96 * MiB, chunk_bytes=16 * MiB, runtime="mlock", register_workers=2)
    if mode == "async":
        async with pool:
            during = locked_bytes()
            pool.tensor.fill_(1)
    else:
        with pool:
            during = locked_bytes()
            pool.tensor.fill_(1)
    assert during - vmlck_baseline == 96 * MiB
    assert len(pool.plan.chunks) == 6
    assert locked_bytes() == vmlck_baseline


@pytest.mark.parametrize("granularity", [60, 300 * 1024, 6000])
def test_unaligned_granularity_locks_exactly_the_pool(granularity: int, vmlck_baseline: int) -> None:
    """Chunks on lcm(granularity, page) boundaries: unlocking one never unlocks a neighbour's page."""
    layout = pinpool.layouts.Raw(granularity_bytes=granularity)
    with pinpool.PinnedPool(
        layout=layout, size=64 * MiB, chunk_bytes=8 * MiB, runtime="mlock", register_workers=2
    ) as pool:
        assert locked_bytes() - vmlck_baseline == -(-pool.nbytes // 4096) * 4096
        assert all(c.offset % granularity == 0 and c.offset % 4096 == 0 for c in pool.plan.chunks)
    assert locked_bytes() == vmlck_baseline


@each_driver
async def test_failure_rolls_back_real_locks(mode: str, vmlck_baseline: int) -> None:
    runtime = FailingMlock(fail_on={4})
    pool = pinpool.PinnedPool(size=64 * MiB, chunk_bytes=8 * MiB, runtime=runtime, register_workers=1)
    with pytest.raises(pinpool.PinError) as info:
        if mode == "async":
            async with pool:
                pytest.fail("body must not run")
        else:
            with pool:
                pytest.fail("body must not run")
    assert info.value.offset == 24 * MiB and info.value.reason == "ENOMEM"
    assert runtime.registered == {}
    assert locked_bytes() == vmlck_baseline


@pytest.mark.parametrize("populate", [False, True])
async def test_cancellation_rolls_back_real_locks(vmlck_baseline: int, populate: bool) -> None:
    import time

    class SlowMlock(MlockRuntime):
        def register(self, ptr: int, nbytes: int) -> None:
            super().register(ptr, nbytes)
            time.sleep(0.02)

        def lock_on_fault(self, ptr: int, nbytes: int) -> None:
            super().lock_on_fault(ptr, nbytes)
            time.sleep(0.02)

    runtime = SlowMlock()
    pool = pinpool.PinnedPool(
        size=128 * MiB, chunk_bytes=4 * MiB, runtime=runtime, register_workers=2, populate=populate
    )
    with anyio.move_on_after(0.1) as scope:
        async with pool:
            pytest.fail("body must not run")
    assert scope.cancelled_caught
    assert runtime.registered == {}
    assert locked_bytes() == vmlck_baseline


def test_populate_and_huge_pages_lock_for_real(vmlck_baseline: int) -> None:
    pool = pinpool.PinnedPool(size=64 * MiB, chunk_bytes=16 * MiB, runtime="mlock", populate=True, huge_pages=True)
    with pool:
        assert locked_bytes() - vmlck_baseline == 64 * MiB
        assert pool.data_ptr % (2 * MiB) == 0
    assert locked_bytes() == vmlck_baseline


def test_mlock_runtime_refuses_overlap_and_unknown_base() -> None:
    runtime = MlockRuntime()
    with pinpool.PinnedPool(size=8 * MiB, runtime=runtime) as pool:
        with pytest.raises(pinpool.RuntimeCallError) as overlap:
            runtime.register(pool.data_ptr + 4096, 4096)
        assert overlap.value.reason == "EEXIST"
        with pytest.raises(pinpool.RuntimeCallError) as unknown:
            runtime.unregister(pool.data_ptr + 4096)
        assert unknown.value.reason == "EINVAL"
        assert runtime.registered == {pool.data_ptr: 8 * MiB}


_LIMITED_CHILD = textwrap.dedent(
    """
    import dataclasses, json, resource
    import pinpool
    from pinpool._host import libc as _libc
    from pinpool import _probe
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    out = {"cap": _libc.has_cap_ipc_lock(), "soft": soft, "before": _libc.vm_locked_bytes()}
    # The pre-flight refuses the pool before anything is mapped...
    try:
        with pinpool.PinnedPool(size="64MiB", chunk_bytes="1MiB", runtime="mlock", register_workers=1):
            out["entered_despite_preflight"] = True
    except pinpool.ConfigError as exc:
        out["preflight"] = str(exc)
    # ...and when the limit cannot be known in advance, the real mlock failure is a PinError.
    probe = _probe.probe_host
    _probe.probe_host = lambda **kw: dataclasses.replace(probe(**kw), memlock_soft=None)
    try:
        with pinpool.PinnedPool(size="64MiB", chunk_bytes="1MiB", runtime="mlock", register_workers=1):
            out["entered"] = True
    except pinpool.PinError as exc:
        out.update(error=str(exc), reason=exc.reason, offset=exc.offset, code=exc.code, leaked=len(exc.leaked))
    out["after"] = _libc.vm_locked_bytes()
    print(json.dumps(out))
    """
)


def _lowered_memlock_limit() -> int:
    """A limit this process may set (lowering is always allowed; raising the hard one may not be)."""
    _soft, hard = _libc.memlock_limits()
    limit = 8 * MiB if hard == _libc.RLIM_INFINITY else min(8 * MiB, hard)
    return limit // MiB * MiB


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv")
@pytest.mark.skipif(_lowered_memlock_limit() < 2 * MiB, reason="RLIMIT_MEMLOCK hard limit below 2 MiB")
def test_real_mlock_failure_without_cap_ipc_lock_names_the_limit() -> None:
    """Drop CAP_IPC_LOCK and set RLIMIT_MEMLOCK to a few MiB: the chunk past the limit must fail for real."""
    limit = _lowered_memlock_limit()

    def lower_limit() -> None:
        _libc.resource.setrlimit(_libc.resource.RLIMIT_MEMLOCK, (limit, limit))

    command = [
        "setpriv",
        "--inh-caps=-ipc_lock",
        "--bounding-set=-ipc_lock",
        "--",
        sys.executable,
        "-c",
        _LIMITED_CHILD,
    ]
    result = preloaded.run(command, capture_output=True, text=True, timeout=120, preexec_fn=lower_limit)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["cap"] is False and out["soft"] == limit
    assert "entered" not in out and "entered_despite_preflight" not in out
    assert "RLIMIT_MEMLOCK leaves only" in out["preflight"] and "nothing has been mapped" in out["preflight"]
    assert out["reason"] in ("ENOMEM", "EAGAIN", "EPERM")
    assert out["offset"] == limit  # every 1 MiB chunk below the limit fits, the next one does not
    assert "RLIMIT_MEMLOCK" in out["error"] and "CAP_IPC_LOCK absent" in out["error"]
    assert f"soft {limit} bytes" in out["error"] and "ulimit -l" in out["error"]
    assert out["leaked"] == 0
    assert out["after"] == out["before"] == 0


def _smaps_locked_kb(address: int) -> int:
    """Locked kB of the mapping that starts at ``address``, per /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == address
            elif inside and head == "Locked:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping starts at {address:#x}")


@each_driver
async def test_default_pipeline_locks_every_page_on_fault(mode: str, vmlck_baseline: int) -> None:
    """mlock's default order: lock-on-fault first, then parallel faulting locks each page."""
    pool = pinpool.PinnedPool(size=96 * MiB, chunk_bytes=16 * MiB, runtime="mlock", populate_workers=2)
    assert pool.plan.order.value == "register_first" and pool.plan.populate
    seen: list[int] = []
    await pin_and_run(pool, mode, lambda p: seen.extend((locked_bytes(), _smaps_locked_kb(p.data_ptr))))
    during, locked_kb = seen
    assert during - vmlck_baseline == 96 * MiB
    assert locked_kb * 1024 == 96 * MiB  # every page resident and locked, not just marked
    assert locked_bytes() == vmlck_baseline


def test_huge_pages_fault_first_then_lock(vmlck_baseline: int) -> None:
    pool = pinpool.PinnedPool(size=64 * MiB, chunk_bytes=16 * MiB, runtime="mlock", huge_pages=True)
    assert pool.plan.order.value == "populate_first"
    with pool:
        assert _smaps_locked_kb(pool.data_ptr) * 1024 == 64 * MiB
    assert locked_bytes() == vmlck_baseline


def test_numa_node_binds_the_pool(vmlck_baseline: int) -> None:
    node = _libc.numa_nodes()[0]
    with pinpool.PinnedPool(size=8 * MiB, runtime="mlock", numa_node=node) as pool:
        with open("/proc/self/numa_maps") as numa_maps:
            line = next(x for x in numa_maps if int(x.split()[0], 16) == pool.data_ptr)
        assert f"bind:{node}" in line
        assert _smaps_locked_kb(pool.data_ptr) * 1024 == 8 * MiB
    assert locked_bytes() == vmlck_baseline


NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


def _reserve_hugetlb(pages: int) -> int:
    """Reserve ``pages`` more 2 MiB hugetlb pages; returns the old setting (skips when not allowed)."""
    try:
        with open(NR_HUGEPAGES) as f:
            old = int(f.read())
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(old + pages))
    except OSError as exc:
        pytest.skip(f"cannot reserve hugetlb pages here ({exc})")
    if _libc.hugetlb_free_pages()[0] < pages:
        _set_hugetlb(old)
        pytest.skip("the kernel could not reserve the hugetlb pages (memory fragmented)")
    return old


def _set_hugetlb(value: int) -> None:
    with open(NR_HUGEPAGES, "w") as f:
        f.write(str(value))


@hugetlb_pages
@each_driver
async def test_hugetlb_pool_uses_reserved_pages_and_returns_them(mode: str, vmlck_baseline: int) -> None:
    old = _reserve_hugetlb(16)
    try:
        free_before = _libc.hugetlb_free_pages()[0]
        pool = pinpool.PinnedPool(size=32 * MiB, chunk_bytes=8 * MiB, runtime="mlock", huge_pages="hugetlb")
        free_during: list[int] = []

        def body(p: pinpool.PinnedPool) -> None:
            free_during.append(_libc.hugetlb_free_pages()[0])
            p.tensor.fill_(3)
            assert int(p.tensor[-1]) == 3

        await pin_and_run(pool, mode, body)
        assert free_before - free_during[0] == 16  # the whole pool came from the reserved pages
        del pool
        import gc

        gc.collect()
        assert _libc.hugetlb_free_pages()[0] == free_before  # unmapped: the pages went back
        assert locked_bytes() == vmlck_baseline
    finally:
        _set_hugetlb(old)


@hugetlb_pages
def test_hugetlb_without_enough_reserved_pages_is_a_config_error() -> None:
    free, _total = _libc.hugetlb_free_pages()
    size = (free + 1) * 2 * MiB
    with pytest.raises(pinpool.ConfigError, match=r"nr_hugepages") as info:
        pinpool.PinnedPool(size=size, runtime="mlock", huge_pages="hugetlb")
    assert f"needs {free + 1} free 2 MiB hugetlb pages" in str(info.value)


@pytest.mark.parametrize("call", ["register", "lock_on_fault"])
def test_a_failed_mlock_leaves_nothing_locked(call: str) -> None:
    """Issue 33 item 4 for mlock: the kernel marks the mappings locked before it faults them and stops
    at a hole with ENOMEM, so a failed mlock had locked what came before the hole (8 KiB here, kept
    locked with nothing on the runtime's books)."""
    page = _libc.PAGE_SIZE
    address, err = _libc.mmap_anonymous(4 * page)
    assert not err
    try:
        assert _libc.munmap(address + 2 * page, 2 * page) == 0  # a hole after two mapped pages
        before = locked_bytes()
        runtime = MlockRuntime()
        with pytest.raises(pinpool.RuntimeCallError) as info:
            getattr(runtime, call)(address, 4 * page)
        assert info.value.reason == "ENOMEM" and runtime.registered == {}
        assert locked_bytes() == before
    finally:
        _libc.munmap(address, 2 * page)
