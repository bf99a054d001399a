"""Plain values more than one layer shares: what a runtime declares it can do (:class:`Capabilities`),
the CPU quota a cgroup sets (:class:`CpuQuota`: ``_host`` reads it, ``_plan``'s HostFacts holds it), and
the memory pressure a policy sees (:class:`MemoryReading`: ``_host`` reads it, ``_plan``'s elastic
policy decides from it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Capabilities:
    """What a runtime can do beyond ``register(ptr, nbytes)`` / ``unregister(ptr)``, declared, not probed
    (docs/quickstart.md, Runtimes). What pinning costs the host: ``resident`` (registered pages stay
    resident: the pre-flight charges them to the memory cgroup and MemAvailable; False for FakeRuntime)
    and ``charges_memlock`` (registrations count against RLIMIT_MEMLOCK, as mlock's: the limit is checked)."""

    populates: bool = False
    locks_on_fault: bool = False
    finds_pinned: bool = False
    serial_registration: bool = False
    exact_ranges: bool = False
    retryable_codes: frozenset[int] = field(default_factory=frozenset)
    not_registered_codes: frozenset[int] = field(default_factory=frozenset)
    already_registered_codes: frozenset[int] = field(default_factory=frozenset)
    stale_codes: bool = False
    resident: bool = True
    charges_memlock: bool = False


@dataclass(frozen=True)
class CpuQuota:
    """The CPU quota that binds this process: ``quota_us`` per ``period_us`` (None: no quota known),
    from ``source`` at the cgroup ``path``; ``ignored``: garbage quota files (``"file: 'text'"``)."""

    quota_us: int | None = None
    period_us: int | None = None
    source: str | None = None
    path: str | None = None
    ignored: tuple[str, ...] = ()

    @property
    def cpus(self) -> float | None:
        return None if self.quota_us is None or not self.period_us else self.quota_us / self.period_us


def cgroup_room(limit: int | None, usage: int | None, reclaimable: int | None) -> int | None:
    """``limit - (usage - reclaimable page cache)``: page cache is dropped before the OOM killer runs
    (docker and the kubelet subtract it too). Unknown usage: the limit, an upper bound."""
    if limit is None or usage is None:
        return limit
    return max(0, limit - max(0, usage - (reclaimable or 0)))


@dataclass(frozen=True)
class RegistrarLimits:
    """What a transfer registrar (pinpool.registrars) accepts, declared, not probed. ``max_bytes``: the largest
    one registration (Mooncake's ``max_mr_size``, EFA's 192 GB; None: no limit); ``preferred_bytes``: pinpool
    joins consecutive chunks into registrations up to this (few, large registrations; None: one per chunk);
    ``page_table_entries``: a hardware budget of backing pages over all registrations (EFA: about 22 M);
    ``pins_pages``: its registration pins the pages itself (``ibv_reg_mr``: RLIMIT_MEMLOCK applies);
    ``faults_pages``: its registration touches every page; ``not_registered_codes``: the codes of an
    unregister answer that mean nothing was registered there; ``parallel``: calls may run concurrently."""

    max_bytes: int | None = None
    preferred_bytes: int | None = None
    page_table_entries: int | None = None
    pins_pages: bool = False
    faults_pages: bool = False
    not_registered_codes: frozenset[int] = field(default_factory=frozenset)
    parallel: bool = True


@dataclass(frozen=True)
class PsiLine:
    """One line of a PSI file: the share of time (percent) some or all tasks stalled on memory over the
    last 10, 60 and 300 s, and the stalled time since boot (µs, monotonic: deltas of it are exact)."""

    avg10: float
    avg60: float
    avg300: float
    total_us: int


@dataclass(frozen=True)
class PsiReading:
    """A memory PSI file read once: ``some`` (at least one task stalled), ``full`` (all non-idle tasks
    stalled; None where the kernel writes no such line), and the file it came from (a cgroup v2
    ``memory.pressure``, or the system-wide ``/proc/pressure/memory``)."""

    source: str
    some: PsiLine
    full: PsiLine | None


@dataclass(frozen=True)
class MemoryReading:
    """What an elastic policy sees of the host at one moment, in bytes; ``None``: unknown, or no limit.

    ``psi``: memory stall (None where the kernel has no PSI). The memory cgroup is the one that binds
    (the least room, as :func:`pinpool._host.read_memory_limits` chooses), v1 or v2: its ``usage_bytes``,
    ``limit_bytes`` (``memory.max`` / ``memory.limit_in_bytes``), ``high_bytes`` (v2 ``memory.high``, the
    throttling line; v1 ``memory.soft_limit_in_bytes``, where reclaim starts under host pressure) and
    ``reclaimable_bytes`` (its file page cache, which the kernel drops before any OOM kill: usage at the
    limit made of page cache is not pressure). ``mem_available_bytes``, ``mem_total_bytes``: host-wide."""

    psi: PsiReading | None = None
    cgroup_version: int | None = None
    cgroup_path: str | None = None
    usage_bytes: int | None = None
    limit_bytes: int | None = None
    high_bytes: int | None = None
    reclaimable_bytes: int | None = None
    mem_available_bytes: int | None = None
    mem_total_bytes: int | None = None

    @property
    def working_set_bytes(self) -> int | None:
        """The cgroup's usage less its page cache: what the kernel cannot drop without swap."""
        if self.usage_bytes is None:
            return None
        return max(0, self.usage_bytes - (self.reclaimable_bytes or 0))
