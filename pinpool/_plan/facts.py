"""What pinpool knows about the host, in one frozen value: the planner and the pre-flight take it as
an argument (planning is a pure function; tests and ``pinpool doctor`` build HostFacts by hand for any
host). :func:`pinpool._probe.probe_host` reads it from ``_host``'s probes; probing never initialises CUDA."""

from __future__ import annotations

from dataclasses import dataclass

from .._types import CpuQuota, cgroup_room


@dataclass(frozen=True)
class HostFacts:
    """The host facts a pool plan depends on. Sizes are bytes; ``None`` means unlimited or unknown.
    cpus: the affinity mask's (worker counts use :attr:`cpu_budget`); huge_page_size: the huge page
    pinpool maps with (2 MiB); cgroup_*, mem_available: :class:`~pinpool._host.limits.MemoryLimits`'s;
    locked_bytes: ``VmLck``; hugetlb_* (1g: 1 GiB pages): free and reserved; torch_*: build facts."""

    cpus: int
    page_size: int
    huge_page_size: int
    thp_mode: str | None
    populate_write: bool
    memlock_soft: int | None
    memlock_hard: int | None
    cap_ipc_lock: bool
    cgroup_memory_limit: int | None
    mem_available: int | None
    hugetlb_free: int
    hugetlb_total: int
    numa_nodes: tuple[int, ...]
    address_space_bytes: int
    torch_cuda: str | None
    torch_hip: str | None
    nvidia_driver: bool
    amd_kfd: bool
    # Defaulted: a hand-made host names only what it needs.
    cgroup_memory_usage: int | None = None
    cgroup_memory_reclaimable: int | None = None
    cgroup_version: int | None = None
    cgroup_path: str | None = None
    locked_bytes: int = 0
    thp_defrag: str | None = None
    kernel_release: str = ""
    hugetlb_1g_free: int = 0
    hugetlb_1g_total: int = 0
    cpu_quota: CpuQuota | None = None

    @property
    def cpu_budget(self) -> int:
        """Threads this process can keep busy: the affinity's CPUs, bounded by the CPU quota."""
        return cpu_budget(self.cpus, self.cpu_quota)

    def hugetlb_pages(self, page_size: int) -> tuple[int, int]:
        """``(free, reserved)`` hugetlb pages of ``page_size`` (2 MiB or 1 GiB)."""
        if page_size == 1 << 30:
            return self.hugetlb_1g_free, self.hugetlb_1g_total
        return self.hugetlb_free, self.hugetlb_total

    @property
    def cgroup_room(self) -> int | None:
        """Bytes the memory cgroup can still charge (limit - usage + page cache); None without a limit."""
        return cgroup_room(self.cgroup_memory_limit, self.cgroup_memory_usage, self.cgroup_memory_reclaimable)

    @property
    def memory_available(self) -> int | None:
        """Bytes that may still become resident (:func:`effective_available`)."""
        return effective_available(
            self.cgroup_memory_limit, self.cgroup_memory_usage, self.cgroup_memory_reclaimable, self.mem_available
        )


def cpu_budget(affinity_cpus: int, quota: CpuQuota | None) -> int:
    """Threads this process can keep busy: its CPUs, bounded by ``floor(quota / period)``; at least 1."""
    cpus = None if quota is None else quota.cpus
    return max(1, affinity_cpus if cpus is None else min(affinity_cpus, int(cpus)))


def effective_available(
    limit: int | None, usage: int | None, reclaimable: int | None, mem_available: int | None
) -> int | None:
    """Bytes that may still become resident: the cgroup's room and MemAvailable, whichever is smaller;
    None when neither is known."""
    known = [x for x in (cgroup_room(limit, usage, reclaimable), mem_available) if x is not None]
    return min(known, default=None)
