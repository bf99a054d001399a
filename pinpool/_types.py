"""Plain values more than one layer shares: what a runtime declares it can do (:class:`Capabilities`),
and the CPU quota a cgroup sets (:class:`CpuQuota`), which ``_host``'s probe reads and ``_plan``'s
:class:`~pinpool._plan.HostFacts` holds."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Capabilities:
    """What a runtime can do beyond ``register(ptr, nbytes)`` / ``unregister(ptr)``, declared, not probed;
    docs/quickstart.md (Runtimes) explains each ability. Two more say what pinning costs the host:

    resident: registered pages stay resident for good, so the pre-flight charges a pool against the
        memory cgroup and MemAvailable; False for a runtime that touches no memory (FakeRuntime, so
        tests may plan pools far beyond the host).
    charges_memlock: registrations are charged to RLIMIT_MEMLOCK (mlock), so the pre-flight checks
        the limit; not declared by CUDA and ROCm, whose drivers differ.

    One says what a failed register's code is worth:

    stale_codes: a call may answer a code left by earlier asynchronous work (CUDA and ROCm document
        it), so a register that failed may have registered: pinpool unregisters the range, expecting
        one of ``not_registered_codes``, unless the code is one of ``already_registered_codes`` (the
        registration there is someone else's).
    """

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
    def cpus(self) -> float | None:  # quota / period
        if self.quota_us is None or not self.period_us:
            return None
        return self.quota_us / self.period_us


def cgroup_room(limit: int | None, usage: int | None, reclaimable: int | None) -> int | None:
    """``limit - (usage - reclaimable page cache)``: page cache is dropped before the OOM killer runs
    (docker and the kubelet subtract it too). Unknown usage: the limit, an upper bound."""
    if limit is None:
        return None
    if usage is None:
        return limit
    used = max(0, usage - (reclaimable or 0))
    return max(0, limit - used)
