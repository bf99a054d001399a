"""What a runtime declares it can do (:class:`Capabilities`), and the folders' lazy re-exports."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
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
