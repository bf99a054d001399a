"""Reading the memory a process may still make resident: cgroup v1/v2 limits and MemAvailable,
from fixture trees laid out like ``/`` (``read_memory_limits(root=...)``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pinpool import _probe
from pinpool._host import MemoryLimits, read_mem_available, read_memory_limits
from pinpool._plan import effective_available

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
V1_UNLIMITED = "9223372036854771712"  # what v1 reads back after `echo -1 > memory.limit_in_bytes`


def tree(tmp_path: Path, files: dict[str, str]) -> str:
    """A fake ``/`` under tmp_path holding ``files`` (paths relative to it)."""
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


MEMINFO = "MemTotal:       24683568 kB\nMemFree:        23535116 kB\nMemAvailable:    8388608 kB\n"  # 8 GiB


def available(limits: MemoryLimits) -> int | None:
    """What the pre-flight reads from these limits (HostFacts.memory_available)."""
    cgroup = limits.cgroup_limit_bytes, limits.cgroup_usage_bytes, limits.cgroup_reclaimable_bytes
    return effective_available(*cgroup, limits.mem_available_bytes)


def v2_stat(active: int, inactive: int) -> str:
    return f"anon 1000\nfile {active + inactive}\nactive_file {active}\ninactive_file {inactive}\nshmem 0\n"


# -- cgroup v2 ----------------------------------------------------------------------------------------------


def test_v2_limit_usage_and_page_cache(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/kubepods/pod1/c1\n",
            "proc/meminfo": MEMINFO,
            "sys/fs/cgroup/kubepods/pod1/c1/memory.max": f"{2 * GiB}\n",
            "sys/fs/cgroup/kubepods/pod1/c1/memory.current": f"{512 * MiB}\n",
            "sys/fs/cgroup/kubepods/pod1/c1/memory.stat": v2_stat(64 * MiB, 64 * MiB),
        },
    )
    limits = read_memory_limits(root)
    assert limits == MemoryLimits(
        cgroup_version=2,
        cgroup_limit_bytes=2 * GiB,
        cgroup_usage_bytes=512 * MiB,
        mem_available_bytes=8 * GiB,
        cgroup_path="/kubepods/pod1/c1",
        cgroup_reclaimable_bytes=128 * MiB,
    )
    assert available(limits) == 2 * GiB - 512 * MiB + 128 * MiB  # page cache is reclaimed before an OOM kill


def test_v2_max_means_no_limit_and_the_usage_is_still_read(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/user.slice\n",
            "proc/meminfo": MEMINFO,
            "sys/fs/cgroup/user.slice/memory.max": "max\n",
            "sys/fs/cgroup/user.slice/memory.current": "4096\n",
        },
    )
    limits = read_memory_limits(root)
    assert (limits.cgroup_version, limits.cgroup_limit_bytes, limits.cgroup_usage_bytes) == (2, None, 4096)
    assert available(limits) == 8 * GiB  # MemAvailable alone


def test_v2_a_parent_limit_binds_its_children(tmp_path: Path) -> None:
    """The effective limit is the one with the least room along the path to the root."""
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/a/b/c\n",
            "proc/meminfo": MEMINFO,
            "sys/fs/cgroup/a/memory.max": f"{3 * GiB}\n",
            "sys/fs/cgroup/a/memory.current": f"{2 * GiB}\n",  # siblings of b use most of a's limit
            "sys/fs/cgroup/a/b/memory.max": f"{4 * GiB}\n",
            "sys/fs/cgroup/a/b/memory.current": f"{100 * MiB}\n",
            "sys/fs/cgroup/a/b/c/memory.max": "max\n",
            "sys/fs/cgroup/a/b/c/memory.current": f"{100 * MiB}\n",
        },
    )
    limits = read_memory_limits(root)
    assert (limits.cgroup_limit_bytes, limits.cgroup_usage_bytes, limits.cgroup_path) == (3 * GiB, 2 * GiB, "/a")
    assert available(limits) == GiB


def test_v2_smallest_limit_wins_when_usage_is_alike(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/a/b\n",
            "sys/fs/cgroup/a/memory.max": f"{GiB}\n",
            "sys/fs/cgroup/a/b/memory.max": f"{4 * GiB}\n",
        },
    )
    limits = read_memory_limits(root)
    assert (limits.cgroup_limit_bytes, limits.cgroup_usage_bytes, limits.cgroup_path) == (GiB, None, "/a")
    assert limits.mem_available_bytes is None
    assert available(limits) == GiB  # usage unknown: the limit is the bound


def test_v2_on_a_hybrid_host_lives_under_unified(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "4:cpu:/x\n0::/svc\n",
            "sys/fs/cgroup/unified/svc/memory.max": f"{GiB}\n",
            "sys/fs/cgroup/unified/svc/memory.current": f"{GiB // 2}\n",
        },
    )
    limits = read_memory_limits(root)
    assert (limits.cgroup_version, limits.cgroup_limit_bytes, available(limits)) == (2, GiB, GiB // 2)


def test_v2_inside_a_cgroup_namespace_reads_the_mount_root(tmp_path: Path) -> None:
    """A container with its own cgroup namespace sees its cgroup as "/" and its files at the root."""
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/\n",
            "sys/fs/cgroup/memory.max": f"{GiB}\n",
            "sys/fs/cgroup/memory.current": f"{GiB // 4}\n",
        },
    )
    limits = read_memory_limits(root)
    assert (limits.cgroup_limit_bytes, limits.cgroup_path, available(limits)) == (GiB, "/", 3 * GiB // 4)


def test_a_path_outside_the_namespace_is_ignored(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {"proc/self/cgroup": "0::/../../other\n", "sys/fs/cgroup/memory.max": f"{GiB}\n", "proc/meminfo": MEMINFO},
    )
    assert read_memory_limits(root) == MemoryLimits(mem_available_bytes=8 * GiB)


# -- cgroup v1 ----------------------------------------------------------------------------------------------


def v1_files(path: str, limit: str, usage: int, cache: int = 0) -> dict[str, str]:
    base = f"sys/fs/cgroup/memory{path}"
    return {
        f"{base}/memory.limit_in_bytes": limit + "\n",
        f"{base}/memory.usage_in_bytes": f"{usage}\n",
        f"{base}/memory.stat": (
            f"cache {cache}\nrss 1\nactive_file {cache // 2}\ninactive_file {cache - cache // 2}\n"
            f"total_active_file {cache // 2}\ntotal_inactive_file {cache - cache // 2}\n"
        ),
    }


def test_v1_limit_usage_and_page_cache(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "9:name=systemd:/\n4:memory:/docker/abc\n3:cpuset:/\n0::/\n",
            "proc/meminfo": MEMINFO,
            **v1_files("/docker/abc", str(2 * GiB), 300 * MiB, cache=100 * MiB),
            **v1_files("/docker", V1_UNLIMITED, 5 * GiB),
            **v1_files("", V1_UNLIMITED, 9 * GiB),
        },
    )
    limits = read_memory_limits(root)
    assert limits == MemoryLimits(
        cgroup_version=1,
        cgroup_limit_bytes=2 * GiB,
        cgroup_usage_bytes=300 * MiB,
        mem_available_bytes=8 * GiB,
        cgroup_path="/docker/abc",
        cgroup_reclaimable_bytes=100 * MiB,
    )
    assert available(limits) == 2 * GiB - 200 * MiB


def test_v1_huge_value_means_unlimited(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {"proc/self/cgroup": "4:memory:/x\n", "proc/meminfo": MEMINFO, **v1_files("/x", V1_UNLIMITED, GiB)},
    )
    limits = read_memory_limits(root)
    assert (limits.cgroup_version, limits.cgroup_limit_bytes, limits.cgroup_usage_bytes) == (1, None, GiB)
    assert available(limits) == 8 * GiB


def test_v1_container_without_cgroup_namespace_finds_its_files_at_the_mount_root(tmp_path: Path) -> None:
    """/proc/self/cgroup names the host's path (/docker/<id>); the container's mount shows only its own
    cgroup, at the root: the walk up the path finds it there."""
    root = tree(tmp_path, {"proc/self/cgroup": "4:memory:/docker/abc\n", **v1_files("", str(GiB), GiB // 2)})
    limits = read_memory_limits(root)
    assert (limits.cgroup_limit_bytes, limits.cgroup_path, available(limits)) == (GiB, "/", GiB // 2)


def test_v1_co_mounted_controllers(tmp_path: Path) -> None:
    files = {k.replace("cgroup/memory/", "cgroup/cpu,memory/"): v for k, v in v1_files("/x", str(GiB), 0).items()}
    root = tree(tmp_path, {"proc/self/cgroup": "4:cpu,memory:/x\n", **files})
    assert read_memory_limits(root).cgroup_limit_bytes == GiB


def test_v1_parent_limit_binds(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/a/b\n",
            **v1_files("/a", str(GiB), 100 * MiB),
            **v1_files("/a/b", V1_UNLIMITED, 100 * MiB),
        },
    )
    limits = read_memory_limits(root)
    assert (limits.cgroup_limit_bytes, limits.cgroup_path, available(limits)) == (GiB, "/a", 924 * MiB)


# -- missing, unreadable, garbage ---------------------------------------------------------------------------


def test_nothing_at_all(tmp_path: Path) -> None:
    assert read_memory_limits(str(tmp_path)) == MemoryLimits()
    assert read_memory_limits(str(tmp_path / "does-not-exist")) == MemoryLimits()


def test_no_memory_controller_anywhere(tmp_path: Path) -> None:
    root = tree(tmp_path, {"proc/self/cgroup": "1:cpu:/x\n0::/\n", "proc/meminfo": MEMINFO})
    assert read_memory_limits(root) == MemoryLimits(mem_available_bytes=8 * GiB)


@pytest.mark.parametrize(
    "limit",
    ["", "garbage", "-1", "1_000", "١٠٠٠", "1e9", "0x1000", "12 34", "\x00\x01", "max max", "99999999999999999999999"],
)
def test_garbage_limits_read_as_unknown(tmp_path: Path, limit: str) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/x\n",
            "sys/fs/cgroup/x/memory.max": limit,
            "sys/fs/cgroup/x/memory.current": "4096",
            "sys/fs/cgroup/x/memory.stat": "active_file x\ninactive_file\n",
        },
    )
    limits = read_memory_limits(root)
    assert (limits.cgroup_version, limits.cgroup_limit_bytes, limits.cgroup_usage_bytes) == (2, None, 4096)
    assert limits.cgroup_reclaimable_bytes is None


@pytest.mark.parametrize(
    "proc_cgroup",
    ["", "\n\n", "garbage", "0:", "::::", "0::\x00", "4:memory", b"\xff\xfe".decode("latin-1"), "0::/x" * 10000],
)
def test_garbage_proc_cgroup_never_raises(tmp_path: Path, proc_cgroup: str) -> None:
    root = tree(tmp_path, {"proc/self/cgroup": proc_cgroup, "proc/meminfo": MEMINFO})
    limits = read_memory_limits(root)
    assert limits.mem_available_bytes == 8 * GiB and limits.cgroup_limit_bytes is None


def test_unreadable_and_non_utf8_files(tmp_path: Path) -> None:
    root = tree(tmp_path, {"proc/self/cgroup": "0::/x\n"})
    (tmp_path / "sys/fs/cgroup/x/memory.max").mkdir(parents=True)  # a directory where a file should be
    (tmp_path / "sys/fs/cgroup/x/memory.current").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "proc/meminfo").write_bytes(b"MemAvailable: \xff kB\n")
    assert read_memory_limits(root) == MemoryLimits()


@pytest.mark.parametrize(
    ("meminfo", "expected"),
    [
        ("MemAvailable:   2048 kB\n", 2 * MiB),
        ("MemTotal: 1 kB\nMemAvailable:0 kB\n", None),  # no space: not the kernel's format
        ("MemAvailable:   0 kB\n", 0),
        ("MemAvailable:   2048\n", None),
        ("MemAvailable:   2048 MB\n", None),
        ("MemAvailable:   -5 kB\n", None),
        ("MemAvailable:   ٢٠ kB\n", None),
        ("MemFree: 5 kB\n", None),  # kernels before 3.14 have no MemAvailable
        ("", None),
    ],
)
def test_mem_available(tmp_path: Path, meminfo: str, expected: int | None) -> None:
    path = tmp_path / "meminfo"
    path.write_text(meminfo)
    assert read_mem_available(str(path)) == expected


@settings(max_examples=200, deadline=None)
@given(
    proc=st.text(max_size=80),
    limit=st.text(max_size=24) | st.integers(-(2**70), 2**70).map(str),
    usage=st.text(max_size=24) | st.integers(-(2**70), 2**70).map(str),
    stat=st.text(max_size=80),
)
def test_any_file_contents_read_without_raising(
    tmp_path_factory: pytest.TempPathFactory, proc: str, limit: str, usage: str, stat: str
) -> None:
    tmp_path = tmp_path_factory.mktemp("cg")
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": proc,
            "proc/meminfo": stat,
            "sys/fs/cgroup/memory.max": limit,
            "sys/fs/cgroup/memory.current": usage,
            "sys/fs/cgroup/memory.stat": stat,
        },
    )
    limits = read_memory_limits(root)
    for value in dataclasses.astuple(limits):
        assert value is None or isinstance(value, int | str)
    if available(limits) is not None:
        assert available(limits) >= 0


# -- the arithmetic, and the host facts ---------------------------------------------------------------------


def test_effective_available() -> None:
    assert effective_available(None, None, None, None) is None
    assert effective_available(None, 5, 5, 7) == 7
    assert effective_available(10, None, None, None) == 10
    assert effective_available(10, 4, 1, None) == 7
    assert effective_available(10, 4, 1, 3) == 3
    assert effective_available(10, 40, 0, 100) == 0  # over its limit (the kernel allows it briefly)
    assert effective_available(10, 4, 9, 100) == 10  # page cache beyond usage: a racy read, clamped


def test_this_host_reads_without_raising() -> None:
    limits = read_memory_limits()
    assert limits.cgroup_version in (None, 1, 2)
    assert limits.mem_available_bytes is None or limits.mem_available_bytes > 0
    facts = _probe.probe_host()
    assert facts.cgroup_version == limits.cgroup_version and facts.cgroup_path == limits.cgroup_path
    assert facts.locked_bytes >= 0
    if facts.memory_available is not None:
        assert facts.memory_available >= 0


def test_host_facts_memory_available_is_the_smaller_figure() -> None:
    host = dataclasses.replace(_probe.probe_host(), cgroup_memory_limit=None, mem_available=None)
    host = dataclasses.replace(host, cgroup_memory_usage=None, cgroup_memory_reclaimable=None)
    assert host.memory_available is None and host.cgroup_room is None
    host = dataclasses.replace(host, mem_available=8 * GiB)
    assert host.memory_available == 8 * GiB
    host = dataclasses.replace(host, cgroup_memory_limit=2 * GiB, cgroup_memory_usage=GiB)
    assert host.memory_available == host.cgroup_room == GiB
    host = dataclasses.replace(host, cgroup_memory_reclaimable=GiB // 2)
    assert host.memory_available == 3 * GiB // 2
