"""Giving unpinned pages back to the host (``give_back(offset, nbytes)`` on a pool's memory), measured for
real inside a memory cgroup of the test's own: after mlock of N bytes, munlock + give_back, VmLck and the
cgroup's usage fall by N and the host's free memory rises by N; for a shared region on /dev/shm the file's
blocks fall too, once no other process maps it (before, nothing is punched: another process's bytes stay).
The memory is usable after: it reads zero and pins again. Which ranges may be given back is pure
(``checked_range``), tested exhaustively."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pinpool import ConfigError, PoolStateError
from pinpool._errors import RegionInUseError
from pinpool._host import HostMapping, TensorMemory, checked_range
from pinpool._host import libc as _libc
from pinpool._shared import SharedMemory
from tests.conftest import hugetlb_pages
from tests.engine.test_runtime_mlock import NR_HUGEPAGES, _reserve_hugetlb, _set_hugetlb

from .. import preloaded
from ..conftest import needs_mlock
from .cgroup_squeeze import ROOT, MemoryCgroup, memory_cgroup

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE = _libc.PAGE_SIZE
N = 128 * MiB
# The cgroup charges and uncharges in per-CPU batches of 64 pages, and the test's own Python allocates
# a little between two readings: its usage may be this far from the exact figure.
USAGE_SLACK = 2 * MiB
RECORD = {"test": "give_back"}


# -- which ranges: pure ------------------------------------------------------------------------------------


def check(offset: object, nbytes: object, *, data: int = 10 * PAGE - 100, length: int = 10 * PAGE,
          granule: int = PAGE, kind: str = "page") -> tuple[int, int]:  # fmt: skip
    return checked_range(
        offset, nbytes, data_bytes=data, length=length, granule=granule, granule_kind=kind, what="pool memory"
    )


GRANULES = st.sampled_from([(PAGE, "page"), (2 * MiB, "huge page"), (2 * MiB, "hugetlb page"), (GiB, "hugetlb page")])


@given(GRANULES, st.integers(1, 8), st.integers(0, 4095), st.integers(-1, 10), st.integers(-1, 10), st.integers(-5, 5))
def test_a_range_is_taken_exactly_when_it_is_whole_pages_inside_the_mapping(
    granule_kind: tuple[int, str], pages: int, short: int, first: int, count: int, nudge: int
) -> None:
    granule, kind = granule_kind
    length = pages * granule
    data = length - short % granule  # the pool's bytes end inside its last page, or at its end
    offset, nbytes = first * granule, count * granule + nudge
    end = offset + nbytes
    whole = offset % granule == 0 and (end % granule == 0 or end == data)
    expected = offset >= 0 and nbytes >= 0 and end <= length and (nbytes == 0 or whole)
    if not expected:
        with pytest.raises(ConfigError, match=r"^pool memory\.give_back\(offset=-?\d+, nbytes=-?\d+\): "):
            check(offset, nbytes, data=data, length=length, granule=granule, kind=kind)
        return
    got = check(offset, nbytes, data=data, length=length, granule=granule, kind=kind)
    if nbytes == 0:
        assert got == (offset, 0)
    else:  # the padding after the pool's last byte goes with its last page
        assert got == (offset, (length if end == data else end) - offset)


def test_a_range_of_parts_of_pages_names_the_whole_pages_inside_it() -> None:
    with pytest.raises(ConfigError) as info:
        check(100, 3 * PAGE)
    assert str(info.value) == (
        f"pool memory.give_back(offset=100, nbytes={3 * PAGE}): the offset 100 is not a multiple of 4 KiB (the OS "
        f"page); only whole pages can be given back to the host; give back [{PAGE}, +{2 * PAGE}) instead (the "
        "whole pages inside the range)"
    )
    with pytest.raises(ConfigError, match=r"the end \(offset \+ nbytes\) 6144 is not a multiple of 4 KiB"):
        check(PAGE, 2048)  # no whole page in it:
    with pytest.raises(ConfigError, match=r"the range holds no whole page: give back a larger one$"):
        check(PAGE, 2048)
    with pytest.raises(ConfigError, match=r"2 MiB \(a transparent huge page: a part of one is split off and freed"):
        check(PAGE, PAGE, length=4 * MiB, data=4 * MiB, granule=2 * MiB, kind="huge page")


@pytest.mark.parametrize(
    ("offset", "nbytes", "problem"),
    [
        (True, PAGE, "offset must be an int number of bytes, not bool"),
        (0, 4096.0, "nbytes must be an int number of bytes, not float"),
        (-PAGE, PAGE, "offset and nbytes are byte counts >= 0"),
        (0, -1, "offset and nbytes are byte counts >= 0"),
        (9 * PAGE, 2 * PAGE, f"the range ends at byte {11 * PAGE}, past the memory's {10 * PAGE - 100} B"),
    ],
)
def test_a_range_that_is_no_range_of_the_memory_is_refused(offset: object, nbytes: object, problem: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(problem)):
        check(offset, nbytes)


def test_a_callers_tensor_is_never_given_back_it_can_only_be_unpinned() -> None:
    tensor = torch.ones(4 * PAGE, dtype=torch.uint8)
    with pytest.raises(ConfigError, match=r"the memory is the caller's tensor, which pinpool does not own"):
        TensorMemory(tensor).give_back(0, PAGE)
    assert int(tensor.sum()) == 4 * PAGE  # untouched


def test_transparent_huge_pages_are_given_back_whole() -> None:
    mapping = HostMapping(4 * MiB, huge_pages=True)
    with pytest.raises(ConfigError, match=r"the offset 4096 is not a multiple of 2 MiB \(a transparent huge page"):
        mapping.give_back(PAGE, 2 * MiB)
    mapping.give_back(2 * MiB, 2 * MiB)


# -- measured: private memory ------------------------------------------------------------------------------


def free_bytes() -> int:
    """MemAvailable plus the pages waiting in the per-CPU free lists (/proc/zoneinfo ``count:``). Freed
    pages land there first and MemAvailable leaves them out; with auto-tuned lists (Linux 6.7+) they hold
    hundreds of MiB after a large free and drain into MemAvailable over seconds, yet any allocation takes them."""
    meminfo = Path("/proc/meminfo").read_text()
    available = re.search(r"^MemAvailable:\s+(\d+) kB$", meminfo, re.M)
    assert available is not None, meminfo
    per_cpu = re.findall(r"^\s+count:\s+(\d+)$", Path("/proc/zoneinfo").read_text(), re.M)
    return int(available.group(1)) * KiB + sum(map(int, per_cpu)) * PAGE


def falls(read: Callable[[], int], act: Callable[[], None]) -> int:
    before = read()
    act()
    return before - read()


def free_memory_rise(pin: Callable[[], None], give_back: Callable[[], None]) -> list[int]:
    """How much free memory ``give_back`` gave the host, as seen host-wide: other processes allocate and
    free meanwhile (a CI run beside a test session saw 66, 69 and 217 MiB for 128), so up to eight tries
    (``pin`` before each, ~30 ms) until one is within 25 % of N."""
    seen: list[int] = []
    for _ in range(8):
        pin()
        seen.append(-falls(free_bytes, give_back))
        if abs(seen[-1] - N) <= N // 4:
            break
    return seen


@pytest.fixture
def cgroup() -> Iterator[MemoryCgroup]:
    with memory_cgroup() as group, group.entered():
        yield group


@needs_mlock
def test_private_memory_unpinned_and_given_back_leaves_vmlck_the_cgroup_and_the_host(cgroup: MemoryCgroup) -> None:
    mapping = HostMapping(N)
    view = mapping.view(0, N)

    def pin() -> None:
        view.fill_(7)
        assert _libc.mlock(mapping.address, N) == 0

    def unpin_and_give_back() -> None:
        assert _libc.munlock(mapping.address, N) == 0
        mapping.give_back(0, N)

    pin()
    with pytest.raises(PoolStateError, match=r"still locked \(mlock\) in this process.*unpin the range first"):
        mapping.give_back(0, N)  # refused while pinned: nothing dropped
    assert int(view[N - PAGE :].sum()) == 7 * PAGE
    usage = cgroup.usage()
    assert falls(_libc.vm_locked_bytes, unpin_and_give_back) == N
    assert abs(usage - cgroup.usage() - N) <= USAGE_SLACK
    assert not view.any()  # it reads zero (the zero page: nothing is charged again)
    assert abs(usage - cgroup.usage() - N) <= USAGE_SLACK
    seen = free_memory_rise(pin, unpin_and_give_back)
    assert abs(seen[-1] - N) <= N // 4, f"free memory rose by {[s // MiB for s in seen]} MiB, not ~{N // MiB} MiB"
    pin()  # usable after: it pins again, and holds what is written
    assert _libc.vm_locked_bytes() >= N and int(view[:PAGE].sum()) == 7 * PAGE
    unpin_and_give_back()


@hugetlb_pages
@pytest.mark.parametrize("memory", ["private", "shared"])
def test_hugetlb_pages_go_back_to_the_reserved_pool_whole(memory: str) -> None:
    old = _reserve_hugetlb(3)  # a shared region's trailer takes a page of its own
    try:
        mapping = (
            HostMapping(4 * MiB, huge_pages="hugetlb") if memory == "private" else
            SharedMemory(huge_page_size="2MiB").open_mapping(4 * MiB, RECORD)  # a memfd on hugetlbfs
        )  # fmt: skip
        mapping.view(0, 4 * MiB).fill_(1)
        free = _libc.hugetlb_free_pages()[0]
        with pytest.raises(ConfigError, match=r"the offset 4096 is not a multiple of 2 MiB \(a hugetlb page"):
            mapping.give_back(PAGE, 2 * MiB - PAGE)
        mapping.give_back(2 * MiB, 2 * MiB)
        assert _libc.hugetlb_free_pages()[0] == free + 1
        assert int(mapping.view(0, 2 * MiB).sum()) == 2 * MiB  # the other page kept its bytes
        if memory == "shared":  # a fault in the hole with no free huge page would be a SIGBUS: refused first
            nr = int(Path(NR_HUGEPAGES).read_text())
            _set_hugetlb(nr - _libc.hugetlb_free_pages()[0])  # no free page left
            with pytest.raises(ConfigError, match=r"allocating \[2097152, \+2097152\) \(2 MiB\) of its file failed: .* "
                               r"stays a hole \(it reads zero\). It needs free 2 MiB hugetlb pages"):  # fmt: skip
                mapping.take_back(2 * MiB, 2 * MiB)
            _set_hugetlb(nr)
            mapping.take_back(2 * MiB, 2 * MiB)
            assert _libc.hugetlb_free_pages()[0] == free
        mapping.view(2 * MiB, 2 * MiB).fill_(2)  # usable after: the page comes back from the reserved pool
        assert _libc.hugetlb_free_pages()[0] == free
        del mapping
        gc.collect()
    finally:
        _set_hugetlb(old)


# -- measured: a shared region ---------------------------------------------------------------------------

# Another process mapping the region: the sum of one byte per MiB now, and again after a line on stdin; then
# it exits (one byte per MiB: reading a hole of a shared file allocates a page, and the test counts pages).
ATTACHED = """
import sys
from pinpool._shared import SharedMemory
path, nbytes = sys.argv[1], int(sys.argv[2])
view = SharedMemory(path, create=False).open_mapping(nbytes, {"test": "give_back"}).view(0, nbytes)
print(int(view[:: 1 << 20].sum()), flush=True)
sys.stdin.readline()
print(int(view[:: 1 << 20].sum()), flush=True)
"""


@needs_mlock
def test_a_shared_region_is_given_back_only_once_no_other_process_maps_it(cgroup: MemoryCgroup, shm_dir: Path) -> None:
    """While another process maps the region, a give-back punches nothing (its pool may be using the pages):
    a RegionInUseError, the file's blocks and that process's bytes unchanged. Once it is gone: the file's
    blocks and the cgroup's usage fall by the range, which reads zero."""
    path = shm_dir / "kv"
    mapping = SharedMemory(path, create=True).open_mapping(N, RECORD)
    view = mapping.view(0, N)
    view.fill_(3)
    assert _libc.mlock(mapping.address, N) == 0
    with pytest.raises(PoolStateError, match=r"madvise\(MADV_REMOVE\) refused it \(EINVAL\): part of the range"):
        mapping.give_back(0, N)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", ATTACHED, str(path), str(N)]
    with preloaded.Child(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) as other:
        assert other.stdin is not None and other.stdout is not None
        assert int(other.stdout.readline()) == 3 * (N // MiB)  # it sees the pattern
        assert os.stat(path).st_blocks * 512 == N + PAGE  # the data and the trailer's page
        assert falls(_libc.vm_locked_bytes, lambda: _libc.munlock(mapping.address, N)) == N
        with pytest.raises(RegionInUseError, match=r"\(128 MiB\) was not given back: another process maps the reg"):
            mapping.give_back(0, N)
        assert os.stat(path).st_blocks * 512 == N + PAGE  # nothing punched
        other.stdin.write("again\n")
        other.stdin.flush()
        assert int(other.stdout.readline()) == 3 * (N // MiB)  # its bytes are intact
        assert other.wait(timeout=60) == 0
    usage = cgroup.usage()
    mapping.give_back(0, N)  # this process maps it alone now
    assert os.stat(path).st_blocks * 512 == PAGE  # only the trailer is left
    assert abs(usage - cgroup.usage() - N) <= USAGE_SLACK
    assert mapping.generation == 0  # the trailer is intact
    usage = cgroup.usage()
    mapping.take_back(0, N)  # allocated again before anything touches it (a full tmpfs: an error, no SIGBUS)
    assert os.stat(path).st_blocks * 512 == N + PAGE and abs(cgroup.usage() - usage - N) <= USAGE_SLACK
    assert not view.any()  # what was given back reads zero (read only now: reading a hole allocates it)
    view.fill_(5)  # usable after: it pins again, and holds what is written
    assert _libc.mlock(mapping.address, N) == 0 and int(view[:PAGE].sum()) == 5 * PAGE
    assert _libc.munlock(mapping.address, N) == 0


def test_memory_unmapped_already_has_nothing_to_give_back(shm_dir: Path) -> None:
    private = HostMapping(PAGE)
    shared = SharedMemory(shm_dir / "kv").open_mapping(PAGE, RECORD)
    for mapping in (private, shared):
        mapping._finalizer()  # what collecting it runs
    with pytest.raises(PoolStateError, match=r"^the pool's memory was unmapped: there is nothing left to give back"):
        private.give_back(0, PAGE)
    for call in (shared.give_back, shared.take_back):
        with pytest.raises(PoolStateError, match=r"^shared memory '.*/kv' was unmapped here: there is nothing"):
            call(0, PAGE)
