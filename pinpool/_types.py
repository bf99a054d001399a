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
