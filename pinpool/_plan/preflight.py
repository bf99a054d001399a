"""The pre-flight: every check of a pool against the host, as structured results, before anything is mapped.

Each check is a pure function of values (numbers, :class:`pinpool._host.facts.HostFacts`) that returns
a :class:`Check`: a name, a status (ok / warn / fail; the doctor's own checks add skip), what it
found and the one fix. A pool raises the first failure as :class:`ConfigError`
(:func:`raise_first`); ``pinpool doctor`` (:mod:`pinpool._cli.doctor`) renders them all. So "will this
pool fit here?" has one answer, and each piece of advice one text.

What is checked, in order: the placement (NUMA node, transparent huge pages, the address space,
hugetlb pages: :func:`placement_checks`), then what pinning costs the host (:func:`pinning_checks`):
the memory the pool makes resident against what the process may still make resident (memory
cgroup, MemAvailable, page tables included) and, where the runtime's registrations are charged to
it, RLIMIT_MEMLOCK. Which of those apply is the runtime's declared
:class:`~pinpool.runtimes.Capabilities` (``resident``, ``charges_memlock``), never its name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import RAISE_MEMLOCK, ConfigError
from .._types import Capabilities
from .._units import bytes_text, format_bytes, hugetlb_page_size, human
from .placement import Placement, place

if TYPE_CHECKING:
    from .._host.facts import HostFacts
    from .options import PoolOptions

__all__ = [
    "FAIL",
    "OK",
    "RAISE_MEMLOCK",
    "SKIP",
    "STATUSES",
    "WARN",
    "Check",
    "address_space_check",
    "check_host",
    "check_pinning",
    "hugetlb_check",
    "hugetlb_fix",
    "memlock_check",
    "memory_check",
    "numa_check",
    "pinning_checks",
    "placement_checks",
    "raise_first",
    "resident_fit",
    "thp_check",
]

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
STATUSES = (OK, WARN, FAIL, SKIP)

THP = "/sys/kernel/mm/transparent_hugepage"
# Less than this share of the available memory left over is a warning: the server needs some too.
HEADROOM = 0.10
# Every 4 KiB page mapped needs an 8-byte page-table entry, resident and charged to the memory
# cgroup like the page itself: 0.2% of a pool, 2 GiB per TiB. THP keeps a deposited page table per
# huge page as well (to split it later), so the estimate holds with huge_pages=True too.
_PTE_BYTES = 8


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``status`` is ok / warn / fail (/ skip); ``detail`` what was found;
    ``fix`` what to do about it (empty when there is nothing to do)."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def error(self) -> ConfigError:
        """The pool's error for this failed check: what was found, the fix (a new sentence after a
        detail that ends one), and that nothing was done yet (the pre-flight runs before mapping)."""
        if self.detail.endswith("."):
            text = f"{self.detail} {self.fix[:1].upper()}{self.fix[1:]}"
        else:
            text = f"{self.detail}; {self.fix}"
        return ConfigError(f"{text}; nothing has been mapped or pinned")


def raise_first(checks: Iterable[Check]) -> None:
    """Raise the first failed check as :class:`ConfigError` (warnings do not stop a pool)."""
    for check in checks:
        if check.status == FAIL:
            raise check.error()


# -- the placement: NUMA node, huge pages, address space ----------------------------------------------


def numa_check(node: int | None, nodes: Sequence[int]) -> Check:
    """``numa_node=`` must name a node with memory; without one, the nodes there are."""
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
    """huge_pages=True needs transparent huge pages in 'always' or 'madvise' mode (a failure when
    ``wanted``, a warning otherwise); defrag 'always' with 'always' stalls every fault on the host."""
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


def hugetlb_fix(huge_page_size: int, pages: int | str) -> str:
    """How to reserve ``pages`` hugetlb pages of ``huge_page_size`` in all: 2 MiB pages at run time
    (vm.nr_hugepages); 1 GiB pages on the kernel command line (at run time the kernel rarely finds
    1 GiB of contiguous free memory per page)."""
    if huge_page_size == 1 << 30:
        return (
            f"hugepagesz=1G hugepages={pages} on the kernel command line and reboot; echo {pages} > "
            "/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages works only while memory is unfragmented"
        )
    return f"echo {pages} > /proc/sys/vm/nr_hugepages, or hugepages= on the kernel command line"


def hugetlb_check(
    nbytes: int | None, *, free: int, total: int, huge_page_size: int, wanted: bool, value: str | None = None
) -> Check:
    """huge_pages='hugetlb' needs ``nbytes`` of free pages reserved in the hugetlb pool (vm.nr_hugepages),
    'hugetlb:1GiB' in the 1 GiB pool: a failure when ``wanted``, a warning where pages are reserved
    but too few, else what there is. ``value``: the huge_pages= asked for, for messages."""
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
    """A pool bigger than the process's address space can never be mapped: refused now, in
    microseconds, rather than failing in mmap (or running out of memory planning it)."""
    if mapping_bytes > address_space:
        return Check(
            "address space", FAIL,
            f"size={bytes_text(size)} needs {human(mapping_bytes)} of address space, more than a process on this "
            f"host can map at all ({human(address_space)}, its user address space)",
            "give a size that fits the host's memory",
        )  # fmt: skip
    return Check("address space", OK, f"{human(mapping_bytes)} of {human(address_space)} of address space")


def placement_checks(options: PoolOptions, host: HostFacts, placement: Placement) -> list[Check]:
    """The checks a placement needs and no runtime: NUMA node, THP, address space, hugetlb pages."""
    checks = [numa_check(options.numa_node, host.numa_nodes)]
    if options.huge_pages is True:
        checks.append(thp_check(host.thp_mode, wanted=True))
    checks.append(
        address_space_check(placement.mapping_bytes, size=options.size, address_space=host.address_space_bytes)
    )
    page = hugetlb_page_size(options.huge_pages)
    if page:
        free, total = host.hugetlb_pages(page)
        checks.append(
            hugetlb_check(
                placement.mapping_bytes, free=free, total=total, huge_page_size=page, wanted=True,
                value=str(options.huge_pages),
            )
        )  # fmt: skip
    return checks


# -- what pinning costs: resident memory and RLIMIT_MEMLOCK -----------------------------------------------


def _sources(host: HostFacts) -> tuple[str, str]:
    """Where the available memory figure comes from, and the fix that makes more of it."""
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
    """The most bytes (whole OS pages) that fit in ``available`` with their page tables, as
    :func:`memory_check` charges them: the pool sizes it advises and :func:`pinpool.host_budget`."""
    return max(0, available) * page_size // (page_size + _PTE_BYTES) // page_size * page_size


def memory_check(nbytes: int | None, host: HostFacts, *, subject: str) -> Check:
    """``nbytes`` of new memory (and its page tables) against what the process may still make
    resident: the memory cgroup's room (limit - usage + reclaimable page cache) and MemAvailable,
    the smaller. ``nbytes`` None: only what is available.

    Pinned pages stay resident, so past the cgroup's limit the kernel cannot reclaim them and
    OOM-kills the process (exit 137) instead of failing a call that could be rolled back. Unknown
    figures are not guessed at: a warning, which stops no pool.
    """
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
    """``nbytes`` to mlock against RLIMIT_MEMLOCK: without CAP_IPC_LOCK, the soft limit must cover
    what this process has locked already (VmLck) plus the pool, or mlock fails part-way. ``nbytes``
    None: what the limit allows."""
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


def pinning_checks(
    *, size: int, locked_bytes: int, new_bytes: int | None, host: HostFacts, caps: Capabilities | None,
    new_memory: bool = True,
) -> list[Check]:  # fmt: skip
    """What pinning costs the host, as ``caps`` declares it: ``new_bytes`` of new resident memory
    (None: none, e.g. hugetlb pages, which are reserved, or a caller's tensor, which may be
    resident already) against what may still become resident, and ``locked_bytes`` against
    RLIMIT_MEMLOCK where registrations are charged to it. ``size``: the pool's, for messages."""
    if caps is None or not caps.resident:
        return []
    subject = f"size={bytes_text(size)}" if new_memory else f"pin(tensor) of {bytes_text(size)}"
    checks = []
    if new_bytes:
        checks.append(memory_check(new_bytes, host, subject=subject))
    if caps.charges_memlock:
        checks.append(memlock_check(locked_bytes, host, subject=subject))
    return checks


def check_pinning(
    options: PoolOptions, host: HostFacts, caps: Capabilities | None, *, mapping_bytes: int,
    buffer_bytes: Iterable[int], new_memory: bool = True, new_bytes: int | None = None,
) -> None:  # fmt: skip
    """The memory pre-flight of a pool already placed (its placement checked): ``mapping_bytes``
    mapped, buffers of ``buffer_bytes``. Run again right before mapping, against host figures read
    then, since they change between construction and entry. Raises the first failure.

    New memory: the mapping (none for hugetlb pages, which are reserved, nor for a caller's
    tensor, ``new_memory=False``, which may be resident already); ``new_bytes``: a shared file's
    pool needs only the pages the file does not hold yet, and locks all of them all the same.
    mlock charges the pages each chunk covers: every buffer rounded out to pages (a caller's
    tensor may start mid-page: one page more)."""
    new = (
        (mapping_bytes if new_bytes is None else new_bytes)
        if new_memory and not hugetlb_page_size(options.huge_pages)
        else 0
    )
    page = host.page_size
    locked = sum(-(-nbytes // page) * page for nbytes in buffer_bytes) + (0 if new_memory else page)
    checks = pinning_checks(
        size=options.size, locked_bytes=locked, new_bytes=new, host=host, caps=caps, new_memory=new_memory
    )
    raise_first(checks)


def check_host(
    options: PoolOptions, host: HostFacts, caps: Capabilities | None = None, *, new_memory: bool = True,
    new_bytes: int | None = None,
) -> None:  # fmt: skip
    """The whole pre-flight in one call, before a pool is planned: its placement's checks, then
    (with ``caps``: the runtime's declared capabilities, see
    :func:`pinpool.runtimes._registry.pinning_capabilities`, which reads them from a runtime's class
    without building it) what pinning it costs. Callable before a runtime is resolved, since
    resolving one (CUDA) may initialise a GPU driver, which a doomed configuration should not wait
    for. Raises the first failure as :class:`ConfigError`."""
    placement = place(options, host)
    raise_first(placement_checks(options, host, placement))
    check_pinning(
        options, host, caps, mapping_bytes=placement.mapping_bytes,
        buffer_bytes=[spec.nbytes for spec in placement.specs], new_memory=new_memory, new_bytes=new_bytes,
    )  # fmt: skip
