"""Plain values more than one layer shares: what a runtime declares it can do (:class:`Capabilities`),
and the CPU quota a cgroup sets (:class:`CpuQuota`: ``_host`` reads it, ``_plan``'s HostFacts holds it)."""

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
