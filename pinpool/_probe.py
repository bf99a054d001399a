"""The host's facts, read now: ``_host``'s probes assembled into ``_plan``'s frozen :class:`HostFacts`.
It sits above both, so the planner never knows the probes and the probes never know the planner."""

from __future__ import annotations

import functools
import os

from ._host import libc as _libc
from ._host.limits import available_cpus, read_cpu_quota, read_memory_limits
from ._plan.facts import HostFacts


def probe_host(*, torch_build: bool = True) -> HostFacts:
    """Read this host's facts now (static ones once per process); ``torch_build=False`` leaves
    ``torch_cuda`` / ``torch_hip`` None, importing no torch (``pinpool doctor --no-cuda``)."""
    soft, hard = _libc.memlock_limits()
    free, total = _libc.hugetlb_free_pages()
    free_1g, total_1g = _libc.hugetlb_free_pages(1 << 30)
    torch_cuda, torch_hip = _torch_build() if torch_build else (None, None)
    memory = read_memory_limits()
    return HostFacts(
        cpus=available_cpus(), page_size=_libc.PAGE_SIZE, huge_page_size=_libc.HUGE_PAGE_SIZE,
        thp_mode=_libc.transparent_huge_pages_mode(), populate_write=_libc.populate_write_supported(),
        memlock_soft=None if soft == _libc.RLIM_INFINITY else soft,
        memlock_hard=None if hard == _libc.RLIM_INFINITY else hard,
        cap_ipc_lock=_libc.has_cap_ipc_lock(), cgroup_memory_limit=memory.cgroup_limit_bytes,
        mem_available=memory.mem_available_bytes, hugetlb_free=free, hugetlb_total=total,
        numa_nodes=_libc.numa_nodes(), address_space_bytes=_libc.address_space_bytes(),
        torch_cuda=torch_cuda, torch_hip=torch_hip,
        nvidia_driver=os.path.exists("/proc/driver/nvidia/version"), amd_kfd=os.path.exists("/dev/kfd"),
        cgroup_memory_usage=memory.cgroup_usage_bytes, cgroup_memory_reclaimable=memory.cgroup_reclaimable_bytes,
        cgroup_version=memory.cgroup_version, cgroup_path=memory.cgroup_path, locked_bytes=_locked_bytes(),
        thp_defrag=_libc.sysfs_choice("/sys/kernel/mm/transparent_hugepage/defrag"),
        kernel_release=os.uname().release, hugetlb_1g_free=free_1g, hugetlb_1g_total=total_1g,
        cpu_quota=read_cpu_quota(),
    )  # fmt: skip


@functools.cache
def _torch_build() -> tuple[str | None, str | None]:
    """``torch.version.cuda`` and ``.hip``: attributes of the installed build; nothing is initialised."""
    try:
        import torch  # already imported by pinpool (its layouts); importing it initialises no GPU
    except ImportError:  # pragma: no cover - torch is a dependency
        return None, None
    version = getattr(torch, "version", None)
    cuda, hip = getattr(version, "cuda", None), getattr(version, "hip", None)
    return (str(cuda) if cuda else None), (str(hip) if hip else None)


def _locked_bytes() -> int:
    try:
        return _libc.vm_locked_bytes()
    except (OSError, ValueError, IndexError):  # no /proc: nothing known to be locked
        return 0
