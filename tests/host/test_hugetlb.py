"""hugetlb page sizes for private memory: ``huge_pages="hugetlb"`` (2 MiB pages, as always),
``"hugetlb:2MiB"`` (the same, spelled out) and ``"hugetlb:1GiB"`` (1 GiB pages reserved at boot).

2 MiB pages are reserved here for real (vm.nr_hugepages, restored after); a 1 GiB pool runs only
where 1 GiB pages are reserved already (they can rarely be reserved once memory is in use), and
the 1 GiB planning and pre-flight run everywhere on hand-made host facts."""

from __future__ import annotations

import dataclasses
import gc
import subprocess
import sys
from unittest import mock

import pytest
import torch

import pinpool
from pinpool import _probe
from pinpool._errors import ConfigError
from pinpool._host import libc as _libc
from pinpool._host import unmap_in_pieces
from pinpool._plan import PoolOptions, check_host, plan_pool
from pinpool.runtimes import pinning_capabilities
from pinpool.testing import host_facts, locked_bytes
from tests.conftest import hugetlb_pages
from tests.engine.test_runtime_mlock import _reserve_hugetlb, _set_hugetlb

MiB, GiB = 1 << 20, 1 << 30

HOST = host_facts()
MLOCK = pinning_capabilities("mlock", HOST)


# -- planning and pre-flight, on hand-made host facts ----------------------------------------------------


def test_a_1gib_pool_is_placed_and_chunked_on_whole_1gib_pages() -> None:
    host = dataclasses.replace(HOST, hugetlb_1g_free=4, hugetlb_1g_total=4)
    plan = plan_pool(PoolOptions.create(size=3 * GiB - 4096, huge_pages="hugetlb:1GiB", chunk_bytes=GiB), host, MLOCK)
    assert (plan.align, plan.page_size, plan.mapping_bytes) == (GiB, GiB, 3 * GiB)
    assert [(c.offset, c.nbytes) for c in plan.chunks] == [(0, GiB), (GiB, GiB), (2 * GiB, GiB - 4096)]
    # The default split for workers never cuts a 1 GiB page either.
    default = plan_pool(PoolOptions.create(size=4 * GiB, huge_pages="hugetlb:1GiB"), host, MLOCK)
    assert all(c.offset % GiB == 0 for c in default.chunks) and default.chunks.nbytes == 4 * GiB


def test_chunks_smaller_than_the_hugetlb_page_are_refused_before_anything_is_mapped() -> None:
    host = dataclasses.replace(HOST, hugetlb_1g_free=4, hugetlb_1g_total=4)
    with pytest.raises(ConfigError, match=r"1073741824 B\) is larger than the chunk limit 256 MiB"):
        plan_pool(PoolOptions.create(size=GiB, huge_pages="hugetlb:1GiB", chunk_bytes=256 * MiB), host, MLOCK)


@pytest.mark.parametrize("spelling", ["hugetlb", "hugetlb:2MiB"])
def test_hugetlb_and_hugetlb_2mib_plan_alike_on_2mib_pages(spelling: str) -> None:
    host = dataclasses.replace(HOST, hugetlb_free=8, hugetlb_total=8, hugetlb_1g_free=0)
    plan = plan_pool(PoolOptions.create(size=7 * MiB, huge_pages=spelling, chunk_bytes=4 * MiB), host, MLOCK)
    assert (plan.align, plan.page_size, plan.mapping_bytes) == (2 * MiB, 2 * MiB, 8 * MiB)
    assert [(c.offset, c.nbytes) for c in plan.chunks] == [(0, 4 * MiB), (4 * MiB, 3 * MiB)]


def test_1gib_pages_are_counted_from_their_own_pool_of_pages() -> None:
    plenty_of_2mib = dataclasses.replace(
        HOST, hugetlb_free=4096, hugetlb_total=4096, hugetlb_1g_free=1, hugetlb_1g_total=3
    )
    with pytest.raises(ConfigError) as info:
        check_host(PoolOptions(size=2 * GiB, huge_pages="hugetlb:1GiB"), plenty_of_2mib, MLOCK)
    assert str(info.value).startswith(
        "huge_pages='hugetlb:1GiB' needs 2 free 1 GiB hugetlb pages (2 GiB), but the host has 1 free of 3 reserved; "
        "reserve them first (hugepagesz=1G hugepages=4 on the kernel command line and reboot;"
    )
    # 2 MiB pages are not counted from the 1 GiB pool
    plenty_of_1gib = dataclasses.replace(HOST, hugetlb_1g_free=8, hugetlb_1g_total=8)
    with pytest.raises(ConfigError, match=r"huge_pages='hugetlb:2MiB' needs 1024 free 2 MiB hugetlb pages"):
        check_host(PoolOptions(size=2 * GiB, huge_pages="hugetlb:2MiB"), plenty_of_1gib, MLOCK)
    check_host(PoolOptions(size=2 * GiB, huge_pages="hugetlb:1GiB"), plenty_of_1gib, MLOCK)


def test_hugetlb_pages_are_no_new_memory_in_the_memory_check() -> None:
    """Reserved pages are taken out of MemAvailable already: a 1 GiB-page pool far above it passes."""
    host = dataclasses.replace(HOST, mem_available=GiB, hugetlb_1g_free=8, hugetlb_1g_total=8)
    check_host(PoolOptions(size=6 * GiB, huge_pages="hugetlb:1GiB"), host, MLOCK)
    with pytest.raises(ConfigError, match="available"):
        check_host(PoolOptions(size=6 * GiB), host, MLOCK)


def test_the_host_probe_reads_the_1gib_counters() -> None:
    facts = _probe.probe_host(torch_build=False)
    assert (facts.hugetlb_1g_free, facts.hugetlb_1g_total) == _libc.hugetlb_free_pages(GiB)
    assert facts.hugetlb_pages(GiB) == (facts.hugetlb_1g_free, facts.hugetlb_1g_total)
    assert facts.hugetlb_pages(2 * MiB) == (facts.hugetlb_free, facts.hugetlb_total)


def test_a_1gib_mapping_is_unmapped_in_whole_pages() -> None:
    """munmap refuses part of a hugetlb page (EINVAL): the unmap's pieces are whole 1 GiB pages."""
    calls: list[tuple[int, int]] = []
    with mock.patch.object(_libc, "munmap", lambda address, length: calls.append((address, length)) or 0):
        unmap_in_pieces(1 << 40, 3 * GiB, GiB)
        unmap_in_pieces(1 << 41, 256 * MiB, 2 * MiB)
    assert calls == [(1 << 40, GiB), ((1 << 40) + GiB, GiB), ((1 << 40) + 2 * GiB, GiB),
                     (1 << 41, 128 * MiB), ((1 << 41) + 128 * MiB, 128 * MiB)]  # fmt: skip


# -- this host's pages ------------------------------------------------------------------------------------


@hugetlb_pages
def test_1gib_pages_too_few_is_a_config_error_naming_the_boot_setting() -> None:
    free, total = _libc.hugetlb_free_pages(GiB)
    for make in (
        lambda: pinpool.PinnedPool(size=(free + 1) * GiB, runtime="mlock", huge_pages="hugetlb:1GiB"),
        lambda: pinpool.empty((free + 1) * GiB, dtype=torch.uint8, huge_pages="hugetlb:1GiB"),
    ):
        with pytest.raises(ConfigError) as info:
            make()
        assert f"needs {free + 1} free 1 GiB hugetlb pages" in str(info.value)
        assert f"hugepagesz=1G hugepages={total + 1} on the kernel command line" in str(info.value)


def test_cli_takes_the_1gib_spelling() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pinpool", "plan", "--size", "1GiB", "--huge-pages", "hugetlb:1GiB", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if _libc.hugetlb_free_pages(GiB)[0] >= 1:
        assert result.returncode == 0, result.stderr
        assert '"huge_pages": "hugetlb:1GiB"' in result.stdout
    else:
        assert result.returncode == 2 and "huge_pages='hugetlb:1GiB' needs 1 free 1 GiB hugetlb pages" in result.stderr
    bad = subprocess.run([sys.executable, "-m", "pinpool", "plan", "--huge-pages", "hugetlb:4MiB"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "invalid choice: 'hugetlb:4MiB'" in bad.stderr


@hugetlb_pages
def test_a_hugetlb_2mib_pool_pins_whole_reserved_pages_and_returns_them(vmlck_baseline: int) -> None:
    old = _reserve_hugetlb(4)
    try:
        free_before = _libc.hugetlb_free_pages()[0]
        pool = pinpool.PinnedPool(size=7 * MiB, chunk_bytes=4 * MiB, runtime="mlock", huge_pages="hugetlb:2MiB")
        assert pool.plan.huge_pages == "hugetlb:2MiB"
        with pool:
            assert free_before - _libc.hugetlb_free_pages()[0] == 4  # 7 MiB on four 2 MiB pages
            assert [(c.offset, c.nbytes) for c in pool.registrations] == [(0, 4 * MiB), (4 * MiB, 3 * MiB)]
            assert pool.data_ptr % (2 * MiB) == 0
            pool.tensor.fill_(5)
            assert int(pool.tensor.sum()) == 5 * 7 * MiB
        del pool
        gc.collect()
        assert _libc.hugetlb_free_pages()[0] == free_before  # unmapped: the pages went back
        assert locked_bytes() == vmlck_baseline
        tensor = pinpool.empty(3 * MiB, dtype=torch.uint8, huge_pages="hugetlb:2MiB")
        tensor.fill_(1)  # hugetlb pages leave the free count as they are faulted
        assert tensor.data_ptr() % (2 * MiB) == 0 and free_before - _libc.hugetlb_free_pages()[0] == 2
        del tensor
        gc.collect()
        assert _libc.hugetlb_free_pages()[0] == free_before
    finally:
        _set_hugetlb(old)


@hugetlb_pages
def test_a_1gib_pool_where_the_host_has_1gib_pages(vmlck_baseline: int) -> None:
    free_before, _total = _libc.hugetlb_free_pages(GiB)
    if free_before < 1:
        pytest.skip("no free 1 GiB hugetlb pages are reserved on this host (hugepagesz=1G hugepages=N at boot)")
    with pinpool.PinnedPool(size=GiB, runtime="mlock", huge_pages="hugetlb:1GiB") as pool:
        assert pool.data_ptr % GiB == 0
        assert _libc.hugetlb_free_pages(GiB)[0] == free_before - 1
        pool.tensor[:: 64 * MiB].fill_(9)
        assert int(pool.tensor[:: 64 * MiB].sum()) == 9 * 16
    del pool
    gc.collect()
    assert _libc.hugetlb_free_pages(GiB)[0] == free_before  # unmapped in whole pages: the page went back
    assert locked_bytes() == vmlck_baseline


def test_empty_checks_transparent_huge_pages_right_before_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    """The huge-page check runs with the host's facts read right before mapping (the probes, not HostMapping)."""
    monkeypatch.setattr(_libc, "transparent_huge_pages_mode", lambda: "never")
    monkeypatch.setattr(_libc, "mmap_anonymous", lambda length: pytest.fail("mapped despite the check"))
    with pytest.raises(pinpool.ConfigError, match=r"transparent huge pages.*never"):
        pinpool.empty(MiB, dtype=torch.uint8, huge_pages=True)
