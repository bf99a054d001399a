"""Small value types shared by the plan, the pre-flight, the pipeline, the lifecycle and the runtimes:
what a runtime declares it can do (:class:`Capabilities`); and the folders' lazy re-exports."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Capabilities:
    """What a runtime can do beyond ``register(ptr, nbytes)`` / ``unregister(ptr)``, declared, not probed.

    populates: it has ``populate(ptr, nbytes)``, used instead of MADV_POPULATE_WRITE to pre-fault
        (FakeRuntime: touches nothing, so fault injection needs no real memory).
    locks_on_fault: it has ``lock_on_fault(ptr, nbytes)``, registering a range before it is
        faulted so that faulting it also locks it (mlock2 MLOCK_ONFAULT).
    finds_pinned: it has ``find_pinned(ptr, nbytes) -> str | None``, describing memory in the
        range that is already pinned outside pinpool.
    serial_registration: the runtime serialises registration itself (the CUDA driver's lock), so
        more than one register worker buys nothing.
    exact_ranges: registrations are tracked by exact byte range, so adjacent registrations may
        share an OS page: CUDA, and mlock (which counts the holders of the pages a registration
        covers only in part); False where a page may belong to one registration only (ROCm,
        unverified).
    retryable_codes: register failure codes worth retrying with a smaller chunk
        (CUDA: 2, cudaErrorMemoryAllocation).
    not_registered_codes: unregister failure codes that mean "no registration has this base":
        CUDA's 713 (cudaErrorHostMemoryNotRegistered), HIP's 1062. A registration pinpool made
        that answers one of them at teardown was released by someone else (a server's own
        clean-up unregistering the buffer's base): pinpool records it as released elsewhere,
        not as a failure, and lets the memory go. mlock's is EINVAL, its books' "no range
        registered at this base" (only a caller of the runtime object itself can release a
        registration from them). A range whose register call failed untrusted (it may or may
        not be registered) that answers one of them was never registered: fine, not a leak.
    resident: registering a range makes its pages resident for good (neither swapped out nor
        reclaimed), so the pre-flight charges a pool against the memory cgroup and MemAvailable.
        True for anything that pins for real (the default: a runtime's purpose); False for one
        that touches no memory (FakeRuntime, so tests may plan pools far beyond the host).
    charges_memlock: registrations are charged to RLIMIT_MEMLOCK (mlock), so the pre-flight
        checks the limit. Not declared by CUDA and ROCm: whether their drivers charge it depends
        on the driver.
    """

    populates: bool = False
    locks_on_fault: bool = False
    finds_pinned: bool = False
    serial_registration: bool = False
    exact_ranges: bool = False
    retryable_codes: frozenset[int] = field(default_factory=frozenset)
    not_registered_codes: frozenset[int] = field(default_factory=frozenset)
    resident: bool = True
    charges_memlock: bool = False


def lazy_exports(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], object], list[str]]:
    """A folder ``__init__``'s ``__getattr__`` and ``__all__``: ``homes`` maps each of its modules to the
    names it lends, space-separated. Tests import from the folder, never from a file in it, so a file
    can move without touching them; package modules import each other directly. A name loads on first
    use, so the folder imports nothing (no cycle, and no torch where ``pinpool --help`` starts)."""
    where = {name: module for module, names in homes.items() for name in names.split()}

    def get(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return get, sorted(where)
