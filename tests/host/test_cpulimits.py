"""Reading the CPU time a process may use: cgroup v1/v2 CPU quotas from fixture trees laid out like
``/`` (``read_cpu_quota(root=...)``), the budget they leave, and a real v1 cgroup where we may make one."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pinpool import _probe
from pinpool._host import V1_SOURCE, V2_SOURCE, read_cpu_quota
from pinpool._plan import CpuQuota, cpu_budget

from .test_memlimits import tree


def mountinfo(*mounts: tuple[str, str, str, str]) -> str:
    """mountinfo lines for (root, mount point, fstype, super options)."""
    return "".join(
        f"{30 + i} 23 0:{40 + i} {root} {point} rw,nosuid - {fstype} {fstype} {opts}\n"
        for i, (root, point, fstype, opts) in enumerate(mounts)
    )


V2_ONLY = mountinfo(("/", "/sys/fs/cgroup", "cgroup2", "rw,nsdelegate"))
V1_CPU = mountinfo(
    ("/", "/sys/fs/cgroup/cpu,cpuacct", "cgroup", "rw,cpu,cpuacct"),
    ("/", "/sys/fs/cgroup/memory", "cgroup", "rw,memory"),
)


# -- cgroup v2 ------------------------------------------------------------------------------------------


def test_v2_quota(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/kubepods/pod1/c1\n",
            "proc/self/mountinfo": V2_ONLY,
            "sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "150000 100000\n",
            "sys/fs/cgroup/kubepods/pod1/cpu.max": "max 100000\n",
            "sys/fs/cgroup/kubepods/cpu.max": "max 100000\n",
        },
    )
    quota = read_cpu_quota(root)
    assert quota == CpuQuota(150000, 100000, V2_SOURCE, "/kubepods/pod1/c1")
    assert quota.cpus == 1.5
    assert cpu_budget(8, quota) == 1  # 1.5 CPUs keep one thread busy, not two


def test_a_parents_tighter_quota_binds(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/kubepods/pod1/c1\n",
            "proc/self/mountinfo": V2_ONLY,
            "sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "800000 100000\n",  # 8 CPUs for the container
            "sys/fs/cgroup/kubepods/pod1/cpu.max": "200000 50000\n",  # 4 CPUs for the pod: binds
            "sys/fs/cgroup/kubepods/cpu.max": "max 100000\n",
        },
    )
    quota = read_cpu_quota(root)
    assert (quota.quota_us, quota.period_us, quota.path) == (200000, 50000, "/kubepods/pod1")
    assert cpu_budget(16, quota) == 4 and cpu_budget(2, quota) == 2  # the affinity binds when it is smaller


def test_v2_max_is_no_quota(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {"proc/self/cgroup": "0::/user.slice\n", "proc/self/mountinfo": V2_ONLY,
         "sys/fs/cgroup/user.slice/cpu.max": "max 100000\n"},
    )  # fmt: skip
    quota = read_cpu_quota(root)
    assert quota == CpuQuota() and quota.cpus is None and cpu_budget(6, quota) == 6


def test_a_bind_mounted_subtree_maps_through_the_mounts_root(tmp_path: Path) -> None:
    """A container without a cgroup namespace sees its own cgroup at /sys/fs/cgroup, while
    /proc/self/cgroup names the host's path: mountinfo's root field joins them."""
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/docker/abc123\n",
            "proc/self/mountinfo": mountinfo(("/docker/abc123", "/sys/fs/cgroup", "cgroup2", "rw")),
            "sys/fs/cgroup/cpu.max": "200000 100000\n",
        },
    )
    quota = read_cpu_quota(root)
    assert (quota.cpus, quota.path) == (2.0, "/docker/abc123")


def test_a_mount_point_with_a_space(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {"proc/self/cgroup": "0::/a\n", "proc/self/mountinfo": mountinfo(("/", "/cg\\040roups", "cgroup2", "rw")),
         "cg roups/a/cpu.max": "50000 100000\n"},
    )  # fmt: skip
    assert read_cpu_quota(root).cpus == 0.5


# -- cgroup v1 ------------------------------------------------------------------------------------------


def test_v1_quota_on_the_cpu_cpuacct_hierarchy(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/kubepods/podx\n3:cpu,cpuacct:/kubepods/podx\n0::/\n",
            "proc/self/mountinfo": V1_CPU,
            "sys/fs/cgroup/cpu,cpuacct/kubepods/podx/cpu.cfs_quota_us": "300000\n",
            "sys/fs/cgroup/cpu,cpuacct/kubepods/podx/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/cpu,cpuacct/kubepods/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu,cpuacct/kubepods/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    quota = read_cpu_quota(root)
    assert quota == CpuQuota(300000, 100000, V1_SOURCE, "/kubepods/podx")
    assert cpu_budget(192, quota) == 3


def test_v1_unlimited(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {"proc/self/cgroup": "1:cpu:/\n",
         "proc/self/mountinfo": mountinfo(("/", "/sys/fs/cgroup/cpu", "cgroup", "rw,cpu")),
         "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"},
    )  # fmt: skip
    assert read_cpu_quota(root) == CpuQuota()


def test_without_mountinfo_the_usual_places_are_read(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {"proc/self/cgroup": "2:cpu,cpuacct:/svc\n", "sys/fs/cgroup/cpu,cpuacct/svc/cpu.cfs_quota_us": "100000\n",
         "sys/fs/cgroup/cpu,cpuacct/svc/cpu.cfs_period_us": "100000\n"},
    )  # fmt: skip
    assert read_cpu_quota(root).cpus == 1.0


def test_the_tightest_of_v1_and_v2_binds(tmp_path: Path) -> None:
    """A hybrid host: both hierarchies listed; a quota on either limits the process."""
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "1:cpu:/a\n0::/a\n",
            "proc/self/mountinfo": mountinfo(
                ("/", "/sys/fs/cgroup/cpu", "cgroup", "rw,cpu"), ("/", "/sys/fs/cgroup/unified", "cgroup2", "rw")
            ),
            "sys/fs/cgroup/cpu/a/cpu.cfs_quota_us": "400000\n",
            "sys/fs/cgroup/cpu/a/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/unified/a/cpu.max": "100000 100000\n",
        },
    )
    assert read_cpu_quota(root).source == V2_SOURCE and read_cpu_quota(root).cpus == 1.0


# -- what cannot be read --------------------------------------------------------------------------------


def test_nothing_readable_is_no_quota(tmp_path: Path) -> None:
    assert read_cpu_quota(str(tmp_path)) == CpuQuota()
    assert cpu_budget(4, CpuQuota()) == 4 and cpu_budget(4, None) == 4 and cpu_budget(0, None) == 1


@pytest.mark.parametrize(
    "files",
    [
        {"sys/fs/cgroup/a/cpu.max": "lots 100000\n"},
        {"sys/fs/cgroup/a/cpu.max": "100000 0\n"},
        {"sys/fs/cgroup/a/cpu.max": "+1_0 100000\n"},
        {"sys/fs/cgroup/a/cpu.max": "\x1b[31m\n"},
    ],
)
def test_a_malformed_quota_is_ignored_and_named(tmp_path: Path, files: dict[str, str]) -> None:
    """What the kernel never writes is not guessed at: left out of the budget (a pool still starts),
    but named, as a repr (no escape sequence reaches a terminal), for ``pinpool doctor`` to warn."""
    root = tree(tmp_path, {"proc/self/cgroup": "0::/a\n", "proc/self/mountinfo": V2_ONLY, **files})
    quota = read_cpu_quota(root)
    assert (quota.quota_us, quota.cpus, cpu_budget(4, quota)) == (None, None, 4)
    assert len(quota.ignored) == 1 and "cpu.max" in quota.ignored[0] and "\x1b" not in quota.ignored[0]


def test_a_malformed_level_leaves_the_others(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {"proc/self/cgroup": "0::/a/b\n", "proc/self/mountinfo": V2_ONLY,
         "sys/fs/cgroup/a/b/cpu.max": "garbage\n", "sys/fs/cgroup/a/cpu.max": "200000 100000\n"},
    )  # fmt: skip
    quota = read_cpu_quota(root)
    assert quota.cpus == 2.0 and quota.path == "/a" and len(quota.ignored) == 1


def test_a_path_outside_the_namespace_is_skipped(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {"proc/self/cgroup": "0::/../../escape\n", "proc/self/mountinfo": V2_ONLY,
         "escape/cpu.max": "100000 100000\n", "sys/fs/cgroup/cpu.max": "100000 100000\n"},
    )  # fmt: skip
    assert read_cpu_quota(root) == CpuQuota()


# -- the real host ------------------------------------------------------------------------------------------


def test_the_probe_reads_this_hosts_quota() -> None:
    host = _probe.probe_host(torch_build=False)
    assert host.cpu_quota == read_cpu_quota()
    assert 1 <= host.cpu_budget <= host.cpus == len(os.sched_getaffinity(0))


PROBE = """
import structlog, pinpool
from pinpool import _probe
h = _probe.probe_host(torch_build=False)
with structlog.testing.capture_logs() as logs:
    for background in (False, True):
        with pinpool.PinnedPool(size="2GiB", runtime="mlock", background=background, registry=None) as pool:
            pool.wait_ready_sync()
start = [e for e in logs if e["event"] == "pool.pin.start"]
print(h.cpus, h.cpu_quota.cpus, h.cpu_budget, *(f"{e['populate_workers']}/{e['duty_cycle']}" for e in start))
"""


def test_a_real_v1_cgroup_quota_sizes_the_workers() -> None:
    """Where this host has a v1 ``cpu`` hierarchy and we may make a cgroup there (root), a process
    moved into one with a 1-CPU quota reads it and pins a 2 GiB pool on one populate worker, not one
    per CPU; in the background that worker rests half the time (and the pool still gets ready)."""
    base = Path("/sys/fs/cgroup/cpu")
    if not (base / "cpu.cfs_quota_us").exists() or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a cgroup v1 cpu hierarchy at /sys/fs/cgroup/cpu and 2 CPUs")
    group = base / f"pinpool-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cpu cgroup here ({exc}); run as root on a host with a v1 cpu hierarchy")
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
        script = f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1"'
        out = subprocess.run(
            ["sh", "-c", script, sys.executable, PROBE], capture_output=True, text=True, timeout=300, check=True
        ).stdout.split()
    finally:
        group.rmdir()
    assert out == [str(len(os.sched_getaffinity(0))), "1.0", "1", "1/1.0", "1/0.5"]
