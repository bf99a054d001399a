"""Reading memory pressure once: the parsers on captured kernel texts (v1 and v2, absent files, "max",
garbage), the reader on fixture trees laid out like ``/``, and on this host."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pinpool._host import (
    MemoryReading,
    PressureError,
    PsiLine,
    PsiReading,
    parse_limit,
    parse_meminfo,
    parse_psi,
    psi_file,
    read_memory_limits,
    read_memory_pressure,
)

from .test_memlimits import tree

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
V1_UNLIMITED = "9223372036854771712\n"  # v1's "no limit" (PAGE_COUNTER_MAX pages of 4 KiB)

# Captured on this project's machine (Linux 6.18: /proc/pressure/io and memory); the some-only text is
# the shape of /proc/pressure/cpu before 5.13.
PSI_V2 = (
    "some avg10=0.28 avg60=8.85 avg300=36.14 total=13167169932\n"
    "full avg10=0.15 avg60=1.59 avg300=1.00 total=135812630\n"
)
PSI_IDLE = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
PSI_SOME_ONLY = "some avg10=12.50 avg60=3.00 avg300=100.00 total=42\n"  # cpu before 5.13: no full line
MEMINFO = "MemTotal:       24683568 kB\nMemFree:        13937000 kB\nMemAvailable:    8388608 kB\nBuffers: 1 kB\n"


# -- the parsers --------------------------------------------------------------------------------------------


def test_psi_some_and_full() -> None:
    reading = parse_psi(PSI_V2, "/x/memory.pressure")
    assert reading == PsiReading(
        source="/x/memory.pressure",
        some=PsiLine(avg10=0.28, avg60=8.85, avg300=36.14, total_us=13167169932),
        full=PsiLine(avg10=0.15, avg60=1.59, avg300=1.0, total_us=135812630),
    )
    assert parse_psi(PSI_IDLE, "p").some == PsiLine(0.0, 0.0, 0.0, 0)


def test_psi_without_a_full_line() -> None:
    reading = parse_psi(PSI_SOME_ONLY, "p")
    assert reading.full is None and reading.some == PsiLine(12.5, 3.0, 100.0, 42)


@pytest.mark.parametrize(
    "text",
    [
        "",  # no some line
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",  # full without some
        "some avg10=0.00 avg60=0.00 avg300=0.00\n",  # no total
        "some avg10=x avg60=0.00 avg300=0.00 total=0\n",
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=-1\n",
        "some avg10=1e3 avg60=0.00 avg300=0.00 total=0\n",
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nsome avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        "SOME avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        "<html>",
    ],
)
def test_malformed_psi_is_a_typed_error_naming_the_file_and_text(text: str) -> None:
    with pytest.raises(PressureError) as caught:
        parse_psi(text, "/proc/pressure/memory")
    error = caught.value
    assert error.path == "/proc/pressure/memory" and "/proc/pressure/memory" in str(error)
    assert error.value == repr(text.strip()[:120]) and error.value in str(error)
    assert isinstance(error, RuntimeError)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("536870912\n", 512 * MiB),
        ("0\n", 0),
        ("max\n", None),  # v2 no limit
        (V1_UNLIMITED, None),  # v1 no limit
        ("9223372036854775807\n", None),  # v1 on 64 KiB-page kernels reads back near 2**63 too
    ],
)
def test_limits_and_no_limit(text: str, value: int | None) -> None:
    assert parse_limit(text, "memory.max") == value


@pytest.mark.parametrize("text", ["", "-1\n", "1.5G\n", "max max\n", "1_000\n", "１２\n", "12 kB\n"])
def test_malformed_limit_is_a_typed_error(text: str) -> None:
    with pytest.raises(PressureError, match=r"memory\.high holds") as caught:
        parse_limit(text, "/sys/fs/cgroup/x/memory.high")
    assert caught.value.path == "/sys/fs/cgroup/x/memory.high"


def test_meminfo() -> None:
    assert parse_meminfo(MEMINFO, "m") == (8 * GiB, 24683568 * KiB)
    assert parse_meminfo("MemTotal: 4 kB\n", "m") == (None, 4 * KiB)  # before 3.14: no MemAvailable
    assert parse_meminfo("", "m") == (None, None)
    for bad in ("MemAvailable: 12\n", "MemAvailable: x kB\n", "MemAvailable: 12 MB\n", "MemTotal 12 kB\n"):
        if ":" not in bad:
            assert parse_meminfo(bad, "m") == (None, None)  # not a MemTotal line at all
            continue
        with pytest.raises(PressureError, match="/proc/meminfo holds"):
            parse_meminfo(bad, "/proc/meminfo")


@given(st.text(max_size=200))
def test_the_parsers_raise_only_pressure_errors(text: str) -> None:
    for parse in (parse_psi, parse_limit, parse_meminfo):
        try:
            parse(text, "f")  # type: ignore[operator]
        except PressureError as error:
            assert error.path == "f"


# -- the reader, on fixture trees ---------------------------------------------------------------------------


def v2_host(tmp_path: Path, *, high: str = "max\n", psi: str | None = PSI_V2) -> str:
    files = {
        "proc/self/cgroup": "0::/kubepods/pod1/c1\n",
        "proc/meminfo": MEMINFO,
        "proc/pressure/memory": PSI_IDLE,
        "sys/fs/cgroup/kubepods/pod1/c1/memory.max": f"{2 * GiB}\n",
        "sys/fs/cgroup/kubepods/pod1/c1/memory.high": high,
        "sys/fs/cgroup/kubepods/pod1/c1/memory.current": f"{1536 * MiB}\n",
        "sys/fs/cgroup/kubepods/pod1/c1/memory.stat": f"anon 1\nactive_file {256 * MiB}\ninactive_file {256 * MiB}\n",
    }
    if psi is not None:
        files["sys/fs/cgroup/kubepods/pod1/c1/memory.pressure"] = psi
    return tree(tmp_path, files)


def test_v2_reads_the_cgroups_own_psi_limit_high_and_page_cache(tmp_path: Path) -> None:
    root = v2_host(tmp_path, high=f"{GiB + GiB // 2}\n")
    reading = read_memory_pressure(root)
    assert reading == MemoryReading(
        psi=parse_psi(PSI_V2, f"{root}/sys/fs/cgroup/kubepods/pod1/c1/memory.pressure"),
        cgroup_version=2,
        cgroup_path="/kubepods/pod1/c1",
        usage_bytes=1536 * MiB,
        limit_bytes=2 * GiB,
        high_bytes=1536 * MiB,
        reclaimable_bytes=512 * MiB,
        mem_available_bytes=8 * GiB,
        mem_total_bytes=24683568 * KiB,
    )
    assert reading.working_set_bytes == GiB
    # The same cgroup as the pre-flight's reader chose, with the same figures.
    limits = read_memory_limits(root)
    assert (limits.cgroup_path, limits.cgroup_limit_bytes, limits.cgroup_usage_bytes) == (
        reading.cgroup_path,
        reading.limit_bytes,
        reading.usage_bytes,
    )


def test_v2_without_its_own_psi_file_falls_back_to_the_system_wide_one(tmp_path: Path) -> None:
    root = v2_host(tmp_path, psi=None)
    reading = read_memory_pressure(root)
    assert reading.psi == parse_psi(PSI_IDLE, f"{root}/proc/pressure/memory")
    assert reading.high_bytes is None  # "max"


def test_v1_soft_limit_and_no_limit(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/docker/abc\n0::/\n",
            "proc/meminfo": MEMINFO,
            "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": V1_UNLIMITED,
            "sys/fs/cgroup/memory/docker/abc/memory.soft_limit_in_bytes": f"{GiB}\n",
            "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": f"{300 * MiB}\n",
            "sys/fs/cgroup/memory/docker/abc/memory.stat": f"total_active_file {MiB}\ntotal_inactive_file {MiB}\n",
            "sys/fs/cgroup/unified/memory.pressure": PSI_SOME_ONLY,
        },
    )
    reading = read_memory_pressure(root)
    assert reading.cgroup_version == 1 and reading.cgroup_path == "/docker/abc"
    assert (reading.usage_bytes, reading.limit_bytes, reading.high_bytes) == (300 * MiB, None, GiB)
    assert reading.reclaimable_bytes == 2 * MiB and reading.working_set_bytes == 298 * MiB
    assert reading.psi is not None and reading.psi.source == f"{root}/sys/fs/cgroup/unified/memory.pressure"


def test_v1_limited_ancestor_binds(tmp_path: Path) -> None:
    base = "sys/fs/cgroup/memory"
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/pod/c\n",
            f"{base}/pod/c/memory.limit_in_bytes": V1_UNLIMITED,
            f"{base}/pod/c/memory.usage_in_bytes": "100\n",
            f"{base}/pod/memory.limit_in_bytes": f"{GiB}\n",
            f"{base}/pod/memory.usage_in_bytes": f"{900 * MiB}\n",
            f"{base}/pod/memory.soft_limit_in_bytes": V1_UNLIMITED,
        },
    )
    reading = read_memory_pressure(root)
    assert (reading.cgroup_path, reading.limit_bytes, reading.usage_bytes) == ("/pod", GiB, 900 * MiB)
    assert reading.high_bytes is None and reading.psi is None  # no PSI anywhere in this tree
    assert (reading.mem_available_bytes, reading.mem_total_bytes) == (None, None)  # no /proc/meminfo


def test_no_cgroup_no_psi(tmp_path: Path) -> None:
    root = tree(tmp_path, {"proc/meminfo": MEMINFO})
    assert read_memory_pressure(root) == MemoryReading(mem_available_bytes=8 * GiB, mem_total_bytes=24683568 * KiB)
    assert psi_file(root) is None


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("sys/fs/cgroup/kubepods/pod1/c1/memory.high", "lots\n"),
        ("sys/fs/cgroup/kubepods/pod1/c1/memory.pressure", "some avg10=oops\n"),
        ("proc/meminfo", "MemAvailable: many kB\n"),
    ],
)
def test_a_garbage_file_in_the_tree_raises_naming_it(tmp_path: Path, name: str, text: str) -> None:
    root = v2_host(tmp_path)
    (tmp_path / name).write_text(text)
    with pytest.raises(PressureError) as caught:
        read_memory_pressure(root)
    assert caught.value.path == f"{root}/{name}"


def test_non_ascii_bytes_are_garbage_too(tmp_path: Path) -> None:
    root = v2_host(tmp_path)
    (tmp_path / "sys/fs/cgroup/kubepods/pod1/c1/memory.max").write_bytes(b"\xff\xfe")
    with pytest.raises(PressureError, match=r"memory\.max holds"):
        read_memory_pressure(root)


# -- this host ----------------------------------------------------------------------------------------------


def test_this_host() -> None:
    reading = read_memory_pressure()
    limits = read_memory_limits()
    assert reading.cgroup_version == limits.cgroup_version and reading.cgroup_path == limits.cgroup_path
    assert reading.limit_bytes == limits.cgroup_limit_bytes
    assert reading.mem_total_bytes is not None and reading.mem_available_bytes is not None
    assert 0 < reading.mem_available_bytes <= reading.mem_total_bytes
    if Path("/proc/pressure/memory").exists():
        assert reading.psi is not None and reading.psi.source == psi_file()
        assert 0.0 <= reading.psi.some.avg10 <= 100.0
