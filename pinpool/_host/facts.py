"""What pinpool knows about the host, in one frozen value: the planner and the pre-flight take it as
an argument (planning is a pure function; tests build HostFacts by hand for any host) and ``pinpool
doctor`` reads the host through it. Probing never initialises CUDA."""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

from . import libc as _libc
from .limits import CpuQuota, cgroup_room, cpu_budget, effective_available, read_cpu_quota, read_memory_limits

# User address space without an mmap hint above it (pinpool never passes one): x86-64 [0, 2**47)
# even with LA57, arm64 below 2**48 even with 52-bit VA. Upper bounds: the binary, heap and stack
# share it. Any other 64-bit architecture stays below 2**57; 32-bit: the pointer width.
_USER_ADDRESS_BITS = {"x86_64": 47, "amd64": 47, "aarch64": 48, "arm64": 48}
_OTHER_64_BIT_ADDRESS_BITS = 57


@functools.cache
def address_space_bytes(machine: str | None = None) -> int:
    pointer_bits = ctypes.sizeof(ctypes.c_void_p) * 8
    if pointer_bits < 64:
        return 1 << pointer_bits
    bits = _USER_ADDRESS_BITS.get(machine or os.uname().machine, _OTHER_64_BIT_ADDRESS_BITS)
    return 1 << bits


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class HostFacts:
    """The host facts a pool plan depends on. Sizes are bytes; ``None`` means unlimited or unknown.

    cpus: CPUs in this process's affinity mask; cpu_quota: the binding CPU cgroup quota (None: not
        read); worker counts derive from :attr:`cpu_budget`.
    huge_page_size: the huge page pinpool maps with (2 MiB); thp_mode, thp_defrag: None without THP.
    cap_ipc_lock: the process may lock memory past RLIMIT_MEMLOCK (memlock_soft, memlock_hard).
    cgroup_memory_*, cgroup_version, cgroup_path, mem_available: :class:`~pinpool._host.limits.MemoryLimits`.
    locked_bytes: what this process has mlock-ed already (``VmLck``), charged to RLIMIT_MEMLOCK.
    hugetlb_free, hugetlb_total (2 MiB), hugetlb_1g_free, hugetlb_1g_total: free and reserved pages.
    torch_cuda, torch_hip: ``torch.version`` build facts; nvidia_driver, amd_kfd: the kernel drivers.
    """

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
    # Added later, with defaults, so hand-made hosts in tests and user code keep working.
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
        """Bytes that may still become resident: the cgroup's room (limit - usage + page cache) or
        MemAvailable, whichever is smaller; None when neither is known."""
        return effective_available(
            self.cgroup_memory_limit, self.cgroup_memory_usage, self.cgroup_memory_reclaimable, self.mem_available
        )

    @classmethod
    def probe(cls, *, torch_build: bool = True) -> HostFacts:
        """Read this host's facts now (static ones are read once per process). ``torch_build=False``
        leaves ``torch_cuda`` / ``torch_hip`` unread (None), so nothing imports torch (~2 s):
        ``pinpool doctor --no-cuda``."""
        soft, hard = _libc.memlock_limits()
        free, total = _libc.hugetlb_free_pages()
        free_1g, total_1g = _libc.hugetlb_free_pages(1 << 30)
        torch_cuda, torch_hip = _torch_build() if torch_build else (None, None)
        memory = read_memory_limits()
        return cls(
            cpus=available_cpus(), page_size=_libc.PAGE_SIZE, huge_page_size=_libc.HUGE_PAGE_SIZE,
            thp_mode=_libc.transparent_huge_pages_mode(), populate_write=_libc.populate_write_supported(),
            memlock_soft=None if soft == _libc.RLIM_INFINITY else soft,
            memlock_hard=None if hard == _libc.RLIM_INFINITY else hard,
            cap_ipc_lock=_libc.has_cap_ipc_lock(), cgroup_memory_limit=memory.cgroup_limit_bytes,
            mem_available=memory.mem_available_bytes, hugetlb_free=free, hugetlb_total=total,
            numa_nodes=_libc.numa_nodes(), address_space_bytes=address_space_bytes(),
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
