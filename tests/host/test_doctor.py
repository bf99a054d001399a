"""pinpool doctor's checks, with hand-made hosts: the pool's own pre-flight checks (one host model,
one answer to "will this pool fit here?", one text per piece of advice), plus the doctor's own.

The command itself (exit codes, JSON, the real host) is tested in test_cli.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from pinpool import ConfigError
from pinpool._cli import (
    FAIL,
    OK,
    SKIP,
    WARN,
    Check,
    CudaFacts,
    DoctorFacts,
    check_kernel,
    exit_code,
    render_text,
    run_checks,
)
from pinpool._errors import RAISE_MEMLOCK
from pinpool._host import V2_SOURCE
from pinpool._plan import CpuQuota, PoolOptions
from pinpool.testing import host_facts

from ..conftest import check_host

ROOT = Path(__file__).resolve().parents[2]
MiB, GiB = 1 << 20, 1 << 30

# A roomy host, root-like (CAP_IPC_LOCK), no cgroup limit.
HOST = host_facts(
    memlock_soft=8 * MiB,
    memlock_hard=8 * MiB,
    mem_available=100 * GiB,
    cgroup_memory_usage=GiB,
    cgroup_version=2,
    cgroup_path="/",
    thp_defrag="madvise",
    kernel_release="6.8.0-45",
)


def facts(**host_changes: Any) -> DoctorFacts:
    return DoctorFacts(host=dataclasses.replace(HOST, **host_changes), cuda=CudaFacts(skip_reason="no GPU"), env={})


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_a_good_host_passes() -> None:
    checks = run_checks(facts(), 64 * GiB)
    assert {c.status for c in checks} == {OK, SKIP} and exit_code(checks) == 0
    assert [c.name for c in checks] == ["memlock", "memory", "cgroup", "cpu", "thp", "hugetlb", "hugetlb:1GiB",
                                        "kernel", "numa", "cuda", "engines", "env"]  # fmt: skip


@pytest.mark.parametrize(
    ("soft", "hard", "cap", "size", "status"),
    [
        (8 * MiB, 8 * MiB, True, 64 * GiB, OK),
        (None, None, False, 64 * GiB, OK),
        (8 * MiB, None, False, 64 * GiB, FAIL),
        (8 * MiB, 8 * MiB, False, 64 * GiB, FAIL),
        (128 * GiB, 128 * GiB, False, 64 * GiB, OK),
        (8 * MiB, 8 * MiB, False, None, WARN),
    ],
)
def test_memlock(soft: int | None, hard: int | None, cap: bool, size: int | None, status: str) -> None:
    check = by_name(run_checks(facts(memlock_soft=soft, memlock_hard=hard, cap_ipc_lock=cap), size))["memlock"]
    assert check.status == status
    if status != OK:  # one piece of advice, one text: the pool's
        assert check.fix.startswith(RAISE_MEMLOCK)
        assert "`ulimit -l unlimited`" in check.fix and "`LimitMEMLOCK=infinity`" in check.fix


def test_memory_charges_page_tables_as_the_pool_does() -> None:
    """A size that fits MemAvailable only without its page tables fails in the doctor as in a pool."""
    available = 10 * GiB
    host = dataclasses.replace(HOST, mem_available=available)
    fits = available * 4096 // 4104 // 4096 * 4096
    assert by_name(run_checks(facts(mem_available=available), fits))["memory"].status == WARN  # no headroom
    check_host(PoolOptions(size=fits), host, "mlock")
    too_big = available - 4096  # fits without its page tables, not with
    doctor = by_name(run_checks(facts(mem_available=available), too_big))["memory"]
    assert doctor.status == FAIL and "of page tables" in doctor.detail
    with pytest.raises(ConfigError) as pool:
        check_host(PoolOptions(size=too_big), host, "mlock")
    # The same finding and the same fix; only the subject is spelled as each user gave it.
    assert doctor.detail.split("cannot be pinned here: ")[1] in str(pool.value)
    assert doctor.fix[1:] in str(pool.value)  # the pool starts it as a sentence


def test_memory_statuses() -> None:
    assert by_name(run_checks(facts(mem_available=10 * GiB), None))["memory"].status == OK
    assert by_name(run_checks(facts(mem_available=10 * GiB), 8 * GiB))["memory"].status == OK
    assert by_name(run_checks(facts(mem_available=10 * GiB), int(9.5 * GiB)))["memory"].status == WARN
    failed = by_name(run_checks(facts(mem_available=10 * GiB), 11 * GiB))["memory"]
    assert failed.status == FAIL and "but only 10 GiB is available: MemAvailable is 10 GiB" in failed.detail
    unknown = by_name(run_checks(facts(mem_available=None), GiB))["memory"]
    assert unknown.status == WARN and "/proc" in unknown.fix


def test_the_cgroup_binds_the_memory_check() -> None:
    """The cgroup row says what was found; whether a pool fits it is the memory check's answer."""
    container = {"cgroup_memory_limit": 16 * GiB, "cgroup_memory_usage": 4 * GiB, "cgroup_memory_reclaimable": 2 * GiB,
                 "cgroup_path": "/kubepods/x"}  # fmt: skip
    checks = by_name(run_checks(facts(**container), GiB))
    assert checks["cgroup"].status == OK and "room 14 GiB" in checks["cgroup"].detail
    assert "/kubepods/x (v2)" in checks["cgroup"].detail and checks["memory"].status == OK
    failed = by_name(run_checks(facts(**container, cgroup_version=1), 15 * GiB))["memory"]
    assert failed.status == FAIL and "OOM-killed" in failed.detail and "memory.limit_in_bytes" in failed.fix
    assert by_name(run_checks(facts(**container), 13 * GiB))["memory"].status == WARN
    assert by_name(run_checks(facts(cgroup_version=None), GiB))["cgroup"].status == OK


def test_cpu_shows_the_quota_and_what_pools_use() -> None:
    """The cpu row: the affinity, the quota and its source, the budget, and the workers a pool and a
    background pool default to on it (a 1-CPU quota on 8 CPUs: one each, not eight)."""
    quota = CpuQuota(100_000, 100_000, V2_SOURCE, "/kubepods/pod1")
    cpu = by_name(run_checks(facts(cpu_quota=quota), None))["cpu"]
    assert cpu.status == OK
    assert cpu.detail == (
        "affinity 8 CPUs, quota 1.00 CPUs (100000/100000 us per period, cgroup v2 cpu.max of /kubepods/pod1): "
        "budget 1; default populate workers: up to 1 for a pool, 1 for a background pool busy 50% of the time "
        "(the quota leaves no whole CPU)"
    )
    unlimited = by_name(run_checks(facts(cpu_quota=CpuQuota()), None))["cpu"]
    assert unlimited.detail.startswith("affinity 8 CPUs, no CPU quota: budget 8;")
    assert unlimited.detail.endswith("up to 8 for a pool, 7 for a background pool")
    garbled = CpuQuota(ignored=("/sys/fs/cgroup/a/cpu.max: 'lots 100000'",))
    warned = by_name(run_checks(facts(cpu_quota=garbled), None))["cpu"]
    assert warned.status == WARN and "'lots 100000'" in warned.detail and "populate_workers=" in warned.fix


@pytest.mark.parametrize(
    ("enabled", "defrag", "status"),
    [("madvise", "madvise", OK), ("always", "defer+madvise", OK), ("never", "madvise", WARN), (None, None, WARN),
     ("always", "always", WARN)],
)  # fmt: skip
def test_thp(enabled: str | None, defrag: str | None, status: str) -> None:
    assert by_name(run_checks(facts(thp_mode=enabled, thp_defrag=defrag), None))["thp"].status == status


def test_thp_advice_is_the_pools() -> None:
    check = by_name(run_checks(facts(thp_mode="never"), None))["thp"]
    with pytest.raises(ConfigError) as pool:
        check_host(PoolOptions(size=GiB, huge_pages=True), dataclasses.replace(HOST, thp_mode="never"))
    assert str(pool.value).startswith(f"{check.detail}; {check.fix}")


def test_hugetlb() -> None:
    assert by_name(run_checks(facts(), 64 * GiB))["hugetlb"].status == OK  # none reserved, none needed
    short = by_name(run_checks(facts(hugetlb_free=100, hugetlb_total=200), GiB))["hugetlb"]
    assert short.status == WARN and "echo 612 > /proc/sys/vm/nr_hugepages" in short.fix
    assert by_name(run_checks(facts(hugetlb_free=512, hugetlb_total=512), GiB))["hugetlb"].status == OK
    with pytest.raises(ConfigError) as pool:  # the same numbers and fix in a pool that asks for them
        check_host(PoolOptions(size=GiB, huge_pages="hugetlb"), dataclasses.replace(HOST, hugetlb_free=100,
                                                                                     hugetlb_total=200))  # fmt: skip
    assert short.fix in str(pool.value) and short.detail in str(pool.value)


@pytest.mark.parametrize(
    ("release", "populate_write", "limit", "status", "text"),
    [
        ("6.8.0-45-generic", True, 256 * GiB, OK, "Linux 6.8.0-45-generic"),
        ("6.11.2", True, 256 * GiB, WARN, "cap one pin call (cudaHostRegister) at 2 GB"),
        ("6.13.0", True, None, WARN, "chunk limit here is unknown"),
        ("6.12.1", True, GiB, OK, "keeps chunks at 1 GiB"),
        ("6.14.0", True, 256 * GiB, OK, "Linux 6.14.0"),
        ("5.10.0", False, 256 * GiB, WARN, "no MADV_POPULATE_WRITE"),
        ("weird", True, 256 * GiB, WARN, "cannot parse"),
    ],
)
def test_check_kernel(release: str, populate_write: bool, limit: int | None, status: str, text: str) -> None:
    check = check_kernel(release, populate_write, limit)
    assert check.status == status and text in check.detail


def test_numa() -> None:
    assert by_name(run_checks(facts(), None))["numa"].status == OK
    two = by_name(run_checks(facts(numa_nodes=(0, 1)), None))["numa"]
    assert two.status == OK and "--numa-node" in two.detail


def test_doctor_text_and_exit_code_for_failures() -> None:
    checks = run_checks(facts(cap_ipc_lock=False, kernel_release="6.12.0"), 200 * GiB)
    statuses = {c.name: c.status for c in checks}
    assert statuses["memlock"] == FAIL and statuses["memory"] == FAIL
    assert statuses["kernel"] == WARN and exit_code(checks) == 1
    text = render_text(checks, 200 * GiB)
    assert text.startswith("pinpool doctor for --size 200 GiB:")
    assert re.search(r"\n  fail  memlock +--size 200 GiB needs 200 GiB locked with mlock, but RLIMIT_MEMLOCK "
                     r"leaves only 8 MiB.*\n +fix: raise the limit", text)  # fmt: skip
    assert text.endswith("result: 7 ok, 1 warn, 2 fail, 2 skip")  # skip: cuda, engines (not probed)


def test_hugetlb_1gib_pages() -> None:
    """1 GiB pages have a line of their own, from their own counters, and the pool's advice: the
    kernel command line (1 GiB pages can rarely be reserved once memory is in use)."""
    none = by_name(run_checks(facts(hugetlb_free=512, hugetlb_total=512), 4 * GiB))["hugetlb:1GiB"]
    assert none.status == OK
    assert none.detail == "no 1 GiB hugetlb pages reserved (only huge_pages='hugetlb:1GiB' needs them)"
    short = by_name(run_checks(facts(hugetlb_1g_free=2, hugetlb_1g_total=3), 4 * GiB))["hugetlb:1GiB"]
    assert short.status == WARN
    assert "needs 4 free 1 GiB hugetlb pages (4 GiB), but the host has 2 free of 3" in short.detail
    assert "hugepagesz=1G hugepages=5 on the kernel command line" in short.fix
    enough = by_name(run_checks(facts(hugetlb_1g_free=4, hugetlb_1g_total=8), 4 * GiB))["hugetlb:1GiB"]
    assert enough.status == OK and enough.detail == "4 of 8 1 GiB hugetlb pages free (4 GiB)"
    with pytest.raises(ConfigError) as pool:  # the same numbers and fix in a pool that asks for them
        check_host(PoolOptions(size=4 * GiB, huge_pages="hugetlb:1GiB"),
                   dataclasses.replace(HOST, hugetlb_1g_free=2, hugetlb_1g_total=3))  # fmt: skip
    assert short.fix in str(pool.value) and short.detail in str(pool.value)


def test_one_text_per_piece_of_advice() -> None:
    """The RLIMIT_MEMLOCK advice is written once, in the pre-flight; the doctor has no copy."""
    sources = "\n".join(path.read_text() for path in (ROOT / "pinpool").rglob("*.py"))
    assert sources.count("LimitMEMLOCK=infinity") == 1
    assert "def read_memory_limits" not in (ROOT / "pinpool" / "_cli" / "doctor.py").read_text()
