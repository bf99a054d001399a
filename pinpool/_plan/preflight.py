"""The pre-flight: each check of a pool against the host a pure function returning a :class:`Check`; a
pool raises the first failure, ``pinpool doctor`` renders them all. The placement's checks come first,
then what pinning costs as the runtime's :class:`Capabilities` declare it (never its name)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import RAISE_MEMLOCK, ConfigError, hugetlb_fix
from .._types import Capabilities
from .._units import bytes_text, format_bytes, hugetlb_page_size, human

if TYPE_CHECKING:  # types only: the pre-flight, and with it pinpool doctor, stays torch-free
    from ..layouts._spec import BufferSpec
    from .facts import HostFacts
    from .options import PoolOptions


OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
STATUSES = (OK, WARN, FAIL, SKIP)

THP = "/sys/kernel/mm/transparent_hugepage"
HEADROOM = 0.10  # less of the available memory left over is a warning: the server needs some too
# Every 4 KiB page mapped needs an 8-byte page-table entry, resident and charged to the cgroup: 2 GiB
# per TiB. THP deposits a page table per huge page too (to split it later), so this holds there as well.
_PTE_BYTES = 8


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``status`` (ok / warn / fail / skip), what was found, and the fix (or "")."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def error(self) -> ConfigError:
        end = f" {self.fix[:1].upper()}{self.fix[1:]}" if self.detail.endswith(".") else f"; {self.fix}"
        return ConfigError(f"{self.detail}{end}; nothing has been mapped or pinned")


def raise_first(checks: Iterable[Check]) -> None:
    for check in checks:
        if check.status == FAIL:
            raise check.error()


# -- the placement --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """The buffers' offsets in the one mapping, each aligned to ``align`` (the OS or huge page)."""

    num_pages: int
    specs: tuple[BufferSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int
    align: int
    mapping_bytes: int


def place(options: PoolOptions, host: HostFacts, *, check: bool = True) -> Placement:
    """The one placement of a pool's buffers on ``host``'s page sizes (hugetlb: its page; THP: 2 MiB);
    ``check``: raise its first failed check (off only for arithmetic such as :func:`pinpool.share`)."""
    align = hugetlb_page_size(options.huge_pages) or (host.huge_page_size if options.huge_pages else host.page_size)
    ends = tuple(itertools.accumulate((-(-spec.nbytes // align) * align for spec in options.buffers), initial=0))
    offsets, offset = ends[:-1], ends[-1]
    placement = Placement(
        num_pages=options.size // options.layout.page_bytes, specs=options.buffers, offsets=offsets,
        nbytes=sum(spec.nbytes for spec in options.buffers), align=align, mapping_bytes=max(offset, host.page_size),
    )  # fmt: skip
    if check:
        raise_first(placement_checks(options, host, placement))
    return placement


def numa_check(node: int | None, nodes: Sequence[int]) -> Check:
    listed = ", ".join(map(str, nodes))
    if node is None:
        if len(nodes) <= 1:
            return Check("numa", OK, f"one NUMA node with memory ({listed})")
        return Check(
            "numa", OK, f"{len(nodes)} NUMA nodes with memory ({listed}): bind a pool near its GPU with "
            "numa_node= (--numa-node N)",
        )  # fmt: skip
    if isinstance(node, bool) or not isinstance(node, int) or node not in nodes:
        return Check(
            "numa", FAIL, f"numa_node={node!r} is not a NUMA node with memory on this host (nodes: {listed})",
            "give one of those, or None to let the kernel place the memory",
        )  # fmt: skip
    return Check("numa", OK, f"numa_node={node} has memory (nodes: {listed})")


def thp_check(mode: str | None, *, wanted: bool, defrag: str | None = None) -> Check:
    """THP must be 'always' or 'madvise' (``wanted``: else a failure); defrag 'always' stalls every fault."""
    if mode not in ("always", "madvise"):
        return Check(
            "thp", FAIL if wanted else WARN,
            f"huge_pages=True needs transparent huge pages, but {THP}/enabled is {mode or 'missing'}",
            f"set it to 'madvise' (echo madvise > {THP}/enabled) or use huge_pages=False",
        )  # fmt: skip
    found = f"transparent huge pages: enabled [{mode}], defrag [{defrag or 'unknown'}]"
    if mode == "always" and defrag == "always":
        return Check(
            "thp", WARN, f"{found}: every anonymous page fault on the host may stall in direct compaction",
            f"echo defer+madvise > {THP}/defrag",
        )  # fmt: skip
    return Check("thp", OK, found)


def hugetlb_check(
    nbytes: int | None, *, free: int, total: int, huge_page_size: int, wanted: bool, value: str | None = None
) -> Check:
    """Free reserved hugetlb pages of ``huge_page_size`` for ``nbytes``: too few is a failure when
    ``wanted``, a warning where some are reserved. ``value``: the huge_pages= asked for."""
    page = format_bytes(huge_page_size)
    value = value or ("hugetlb:1GiB" if huge_page_size == 1 << 30 else "hugetlb")
    name = "hugetlb" if huge_page_size == 2 << 20 else f"hugetlb:{page.replace(' ', '')}"
    needed = 0 if nbytes is None else -(-nbytes // huge_page_size)
    if free < needed and (wanted or total):
        return Check(
            name, FAIL if wanted else WARN,
            f"huge_pages={value!r} needs {needed} free {page} hugetlb pages ({human(needed * huge_page_size)}), "
            f"but the host has {free} free of {total} reserved",
            f"reserve them first ({hugetlb_fix(huge_page_size, total - free + needed)}), or use huge_pages=True "
            "(transparent huge pages, nothing to reserve)",
        )  # fmt: skip
    if total == 0:
        return Check(name, OK, f"no {page} hugetlb pages reserved (only huge_pages={value!r} needs them)")
    return Check(name, OK, f"{free} of {total} {page} hugetlb pages free ({format_bytes(free * huge_page_size)})")


def address_space_check(mapping_bytes: int, *, size: int, address_space: int) -> Check:
    if mapping_bytes > address_space:
        return Check(
            "address space", FAIL,
            f"size={bytes_text(size)} needs {human(mapping_bytes)} of address space, more than a process on this "
            f"host can map at all ({human(address_space)}, its user address space)",
            "give a size that fits the host's memory",
        )  # fmt: skip
    return Check("address space", OK, f"{human(mapping_bytes)} of {human(address_space)} of address space")


def huge_pages_check(huge_pages: bool | str, nbytes: int, host: HostFacts) -> Check | None:
    """``huge_pages=`` against the host (None without huge pages)."""
    if huge_pages is True:
        return thp_check(host.thp_mode, wanted=True)
    page = hugetlb_page_size(huge_pages)
    if not page:
        return None
    free, total = host.hugetlb_pages(page)
    return hugetlb_check(nbytes, free=free, total=total, huge_page_size=page, wanted=True, value=str(huge_pages))


def check_huge_pages(huge_pages: bool | str, nbytes: int, host: HostFacts) -> None:
    """Raise what :func:`huge_pages_check` finds wrong (a mapping's last check, with fresh facts)."""
    raise_first(filter(None, [huge_pages_check(huge_pages, nbytes, host)]))


def placement_checks(options: PoolOptions, host: HostFacts, placement: Placement) -> list[Check]:
    mapped = placement.mapping_bytes
    checks = [
        numa_check(options.numa_node, host.numa_nodes),
        address_space_check(mapped, size=options.size, address_space=host.address_space_bytes),
    ]
    huge = huge_pages_check(options.huge_pages, mapped, host)
    if huge is not None:  # THP is judged before the address space, hugetlb pages after it
        checks.insert(1 if options.huge_pages is True else 2, huge)
    return checks


# -- what pinning costs ------------------------------------------------------------------------------------


def _sources(host: HostFacts) -> tuple[str, str]:
    limit, usage, cache = host.cgroup_memory_limit, host.cgroup_memory_usage, host.cgroup_memory_reclaimable
    room, mem = host.cgroup_room, host.mem_available
    mem_text = "MemAvailable is unknown" if mem is None else f"MemAvailable is {human(mem)}"
    host_fix = "or free memory on the host (other processes, other pools)"
    if room is None or limit is None:
        return f"{mem_text} and no memory cgroup limit applies", host_fix
    used = "usage unknown" if usage is None else f"{human(usage)} in use"
    if usage is not None and cache:
        used += f", {human(cache)} of it reclaimable page cache"
    cgroup = f"memory cgroup {host.cgroup_path or '/'} (cgroup v{host.cgroup_version or '?'})"
    cgroup_text = f"the {cgroup} has a limit of {human(limit)} ({used}), leaving {human(room)}"
    if mem is None or room <= mem:  # the cgroup binds
        limit_file = "memory.max" if host.cgroup_version == 2 else "memory.limit_in_bytes"
        return f"{cgroup_text}; {mem_text}", (
            f"raise the container's memory limit ({limit_file} of that cgroup: docker run --memory, "
            "Kubernetes resources.limits.memory) or free memory in it"
        )
    return f"{mem_text} ({cgroup_text})", host_fix


def resident_fit(available: int, page_size: int) -> int:
    """The most whole OS pages' bytes that fit in ``available`` with their page tables."""
    return max(0, available) * page_size // (page_size + _PTE_BYTES) // page_size * page_size


def memory_check(nbytes: int | None, host: HostFacts, *, subject: str) -> Check:
    """``nbytes`` (None: report only) and its page tables against what may still become resident;
    unknown figures are a warning. Why a failure: the message says (OOM-kill, not a rollback)."""
    available = host.memory_available
    if available is None:
        return Check(
            "memory", WARN, "the memory this process may still make resident is unknown: MemAvailable could not be "
            "read from /proc/meminfo and no memory cgroup limit applies", "check /proc is mounted",
        )  # fmt: skip
    sources, fixes = _sources(host)
    if nbytes is None:
        return Check("memory", OK, f"{human(available)} may still become resident: {sources}")
    tables = -(-nbytes // host.page_size) * _PTE_BYTES
    needed = nbytes + tables
    if needed > available:
        fit = resident_fit(available, host.page_size)
        return Check(
            "memory", FAIL,
            f"{subject} cannot be pinned here: it needs {human(needed)} of memory ({human(nbytes)} of pages plus "
            f"{human(tables)} of page tables), but only {human(available)} is available: {sources}. Pinned pages "
            "can be neither swapped out nor reclaimed, so pinning this pool would get the process OOM-killed "
            "(exit 137) rather than fail.",
            f"give a smaller size (at most {human(fit)} fits now), {fixes}",
        )  # fmt: skip
    if available - needed < HEADROOM * available:
        left = human(available - needed)
        return Check(
            "memory", WARN,
            f"{subject} needs {human(needed)} (page tables included), leaving {left} of the {human(available)} "
            f"available: {sources}",
            "leave headroom for the server, the page cache and the kernel: a smaller size",
        )  # fmt: skip
    found = f"{subject} needs {human(needed)} (page tables included) of {human(available)} available: {sources}"
    return Check("memory", OK, found)


def memlock_check(nbytes: int | None, host: HostFacts, *, subject: str) -> Check:
    """``nbytes`` to mlock (None: report only) plus VmLck against RLIMIT_MEMLOCK, without CAP_IPC_LOCK."""
    soft, hard = host.memlock_soft, host.memlock_hard
    limits = f"RLIMIT_MEMLOCK soft {_limit_text(soft)}, hard {_limit_text(hard)}"
    if host.cap_ipc_lock:
        return Check("memlock", OK, f"CAP_IPC_LOCK is set, so the limit does not apply ({limits})")
    if soft is None:
        return Check("memlock", OK, f"{limits}, no CAP_IPC_LOCK needed")
    left = max(0, soft - host.locked_bytes)
    if nbytes is None:
        return Check(
            "memlock", WARN, f"{limits} without CAP_IPC_LOCK ({human(host.locked_bytes)} locked already): pools "
            f"larger than {human(left)} cannot be locked", RAISE_MEMLOCK,
        )  # fmt: skip
    if nbytes > left:
        return Check(
            "memlock", FAIL,
            f"{subject} needs {human(nbytes)} locked with mlock, but RLIMIT_MEMLOCK leaves only {human(left)}: "
            f"soft limit {human(soft)} (hard {_limit_text(hard)}), {human(host.locked_bytes)} already locked by this "
            "process (VmLck), and no CAP_IPC_LOCK, so mlock would fail with ENOMEM part-way.",
            f"{RAISE_MEMLOCK}, or give a smaller size (at most {human(left)} fits now)",
        )  # fmt: skip
    return Check("memlock", OK, f"{limits} covers {subject} ({human(nbytes)} locked)")


def _limit_text(value: int | None) -> str:
    return "unlimited" if value is None else human(value)


def check_pinning(
    options: PoolOptions, host: HostFacts, caps: Capabilities | None, *, mapping_bytes: int,
    buffer_bytes: Iterable[int], new_memory: bool = True, new_bytes: int | None = None,
) -> None:  # fmt: skip
    """The memory pre-flight, raising the first failure; again right before mapping (figures change).
    New memory: the mapping, or ``new_bytes`` a shared file lacks; none for hugetlb pages (reserved) or
    a caller's tensor. Locked: every buffer rounded out to pages (a tensor starting mid-page: one more)."""
    if caps is None or not caps.resident:
        return
    new = mapping_bytes if new_bytes is None else new_bytes
    new = 0 if not new_memory or hugetlb_page_size(options.huge_pages) else new
    page = host.page_size
    locked = sum(-(-nbytes // page) * page for nbytes in buffer_bytes) + (0 if new_memory else page)
    subject = f"size={bytes_text(options.size)}" if new_memory else f"pin(tensor) of {bytes_text(options.size)}"
    if new:
        raise_first([memory_check(new, host, subject=subject)])
    if caps.charges_memlock:
        raise_first([memlock_check(locked, host, subject=subject)])


def check_engine_pins(engines: Sequence[tuple[str, bool]], nbytes: int, host: HostFacts) -> None:
    """A transfer registrar that pins the pages itself (``ibv_reg_mr``: ``pins_pages``) is held to RLIMIT_MEMLOCK
    on its own count (the kernel's ``pinned_vm``), unless the process has CAP_IPC_LOCK."""
    pinning = [name for name, pins in engines if pins]
    soft = host.memlock_soft
    if not pinning or host.cap_ipc_lock or soft is None or nbytes <= soft:
        return
    raise ConfigError(
        f"registrar {pinning[0]!r} pins the pool's pages itself (limits.pins_pages: ibv_reg_mr), which RLIMIT_MEMLOCK "
        f"caps at {human(soft)} without CAP_IPC_LOCK: registering the pool's {human(nbytes)} would fail part-way. "
        f"{RAISE_MEMLOCK}, or give a smaller size (at most {human(soft)})"
    )


def check_host(
    options: PoolOptions, host: HostFacts, caps: Capabilities | None = None, *, new_memory: bool = True,
    new_bytes: int | None = None,
) -> None:  # fmt: skip
    """The whole pre-flight, raising the first failure: the placement's checks, then (with ``caps``,
    read from a runtime's class without building it, so no GPU driver starts) what pinning costs."""
    placement = place(options, host)
    check_pinning(
        options, host, caps, mapping_bytes=placement.mapping_bytes,
        buffer_bytes=[spec.nbytes for spec in placement.specs], new_memory=new_memory, new_bytes=new_bytes,
    )  # fmt: skip
