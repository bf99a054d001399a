"""How much memory this process may still make resident: its memory cgroup (v1 or v2) and MemAvailable.

Pinned pages are resident and can be neither swapped out nor reclaimed. Pinning more than the
process's memory cgroup has left does not fail a call pinpool could roll back: the kernel's
OOM killer ends the process (exit 137). So the pre-flight (:mod:`pinpool._plan.preflight`)
compares a pool with what is read here, before anything is mapped.

Best effort by design: any file may be missing, unreadable or garbage (another kernel, a
container without the cgroup filesystem, a namespace, a test fixture). What cannot be read is
``None``; nothing here raises.

:func:`read_memory_limits` is the public reader: :meth:`pinpool._host.facts.HostFacts.probe`, the one
host model pools and ``pinpool doctor`` both read, takes its fields. ``root`` points it at a
fixture tree laid out like ``/`` (``proc/self/cgroup``, ``proc/meminfo``, ``sys/fs/cgroup/...``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["MemoryLimits", "effective_available", "read_mem_available", "read_memory_limits"]

# The kernel reports "no limit" as PAGE_COUNTER_MAX pages (v1: 9223372036854771712 with 4 KiB
# pages; v2 writes "max"). Anything this large is no limit at all.
_NO_LIMIT = 1 << 62
# Every file read here is a few KiB; a cap keeps a garbage fixture (or /dev/zero) from costing more.
_READ_CAP = 1 << 16
_PATH_MAX = 4096  # the kernel never writes a longer cgroup path
_DIGITS = re.compile(r"[0-9]{1,20}", re.ASCII)  # int() would also take "1_0", "+1", " ١٠ "


@dataclass(frozen=True)
class MemoryLimits:
    """This process's memory figures, in bytes; ``None`` where unknown (or, for the limit, unlimited).

    cgroup_version: 1 or 2, the hierarchy holding the memory controller; None without one.
    cgroup_limit_bytes: the limit that binds: of this process's cgroup and its ancestors (a
        parent's limit binds its children too), the one with the least room left. None: no limit.
    cgroup_usage_bytes: that cgroup's usage (v2 ``memory.current``, v1 ``memory.usage_in_bytes``);
        without a limit, the usage of the process's own cgroup.
    mem_available_bytes: ``MemAvailable`` of /proc/meminfo (the kernel's estimate of what can be
        allocated without swapping, reclaimable page cache included). Host-wide, not per container.
    effective_available_bytes: the smaller of what the cgroup has left and MemAvailable (see
        :func:`effective_available`); None when neither is known.
    cgroup_path: the binding cgroup's path in its hierarchy (``/`` inside a cgroup namespace).
    cgroup_reclaimable_bytes: that cgroup's file page cache (``active_file + inactive_file`` of
        memory.stat), which counts in its usage but the kernel reclaims before it OOM-kills.
    """

    cgroup_version: int | None = None
    cgroup_limit_bytes: int | None = None
    cgroup_usage_bytes: int | None = None
    mem_available_bytes: int | None = None
    effective_available_bytes: int | None = None
    cgroup_path: str | None = None
    cgroup_reclaimable_bytes: int | None = None


def cgroup_room(limit: int | None, usage: int | None, reclaimable: int | None) -> int | None:
    """Bytes a cgroup can still charge before its limit: ``limit - (usage - reclaimable page cache)``.

    Page cache counts in a cgroup's usage but is dropped before the OOM killer runs, so it is
    room too (docker and the kubelet subtract it the same way). Unknown usage: the limit is all
    we know, an upper bound."""
    if limit is None:
        return None
    if usage is None:
        return limit
    used = max(0, usage - (reclaimable or 0))
    return max(0, limit - used)


def effective_available(
    limit: int | None, usage: int | None, reclaimable: int | None, mem_available: int | None
) -> int | None:
    """What may still become resident: the cgroup's room and MemAvailable, whichever is smaller."""
    known = [x for x in (cgroup_room(limit, usage, reclaimable), mem_available) if x is not None]
    return min(known, default=None)


def read_memory_limits(root: str = "/") -> MemoryLimits:
    """Read this process's memory cgroup and MemAvailable (under ``root``). Never raises."""
    try:
        level = _binding_level(_read(os.path.join(root, "proc/self/cgroup")), os.path.join(root, "sys/fs/cgroup"))
        available = read_mem_available(os.path.join(root, "proc/meminfo"))
    except Exception:  # a reader must never stop a pool: an odd host reads as "unknown"  # pragma: no cover
        return MemoryLimits()
    if level is None:
        return MemoryLimits(mem_available_bytes=available, effective_available_bytes=available)
    return MemoryLimits(
        cgroup_version=level.version,
        cgroup_limit_bytes=level.limit,
        cgroup_usage_bytes=level.usage,
        mem_available_bytes=available,
        effective_available_bytes=effective_available(level.limit, level.usage, level.reclaimable, available),
        cgroup_path=level.path,
        cgroup_reclaimable_bytes=level.reclaimable,
    )


def read_mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes, or None (a kernel before 3.14 has none; garbage reads as None)."""
    for line in (_read(meminfo) or "").splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            if len(fields) == 3 and fields[2] == "kB":
                kib = _to_int(fields[1])
                return None if kib is None else kib * 1024
            return None
    return None


# -- the cgroup hierarchy ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Level:
    """One cgroup on the path from the process's own to the root of its hierarchy."""

    version: int
    path: str
    limit: int | None
    usage: int | None
    reclaimable: int | None


# Per version: the limit, usage and stat files, and the memory.stat keys of the file LRU lists
# (v1 has hierarchical total_* keys, which count child cgroups as usage_in_bytes does).
_FILES = {
    2: ("memory.max", "memory.current", (("active_file", "inactive_file"),)),
    1: (
        "memory.limit_in_bytes",
        "memory.usage_in_bytes",
        (("total_active_file", "total_inactive_file"), ("active_file", "inactive_file")),
    ),
}


def _binding_level(proc_cgroup: str | None, mount: str) -> _Level | None:
    """The cgroup whose limit leaves the least room, else the process's own cgroup, else None."""
    levels = list(_levels(proc_cgroup, mount))
    limited = [level for level in levels if level.limit is not None]
    if limited:
        return min(limited, key=lambda level: cgroup_room(level.limit, level.usage, level.reclaimable) or 0)
    return levels[0] if levels else None


def cgroup_paths(proc_cgroup: str | None) -> Iterator[tuple[str, list[str]]]:
    """Each line of ``/proc/self/cgroup`` (``id:controllers:path``) as its controllers ("" for v2)
    and its path's parts. Skipped: a path outside this cgroup namespace (a ``..`` part: nothing
    visible here is an ancestor) and one longer than the kernel writes."""
    for line in (proc_cgroup or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3 or len(fields[2]) > _PATH_MAX:
            continue
        parts = [p for p in fields[2].removesuffix(" (deleted)").split("/") if p not in ("", ".")]
        if ".." not in parts:
            yield fields[1], parts


def _levels(proc_cgroup: str | None, mount: str) -> Iterator[_Level]:
    """Every cgroup of this process that has memory files, deepest first, per hierarchy.

    ``/proc/self/cgroup`` lines are ``id:controllers:path``: ``0::/path`` for v2 (mounted at
    /sys/fs/cgroup, or at /sys/fs/cgroup/unified on hybrid hosts, where it may lack the memory
    controller), ``N:memory:/path`` (or ``N:cpu,memory:/path``) for v1. Ancestors count because
    their limits bind too. In a container without a cgroup namespace the path names the host's
    cgroup, which the container sees as its mount root: the walk up finds the root's files.
    """
    for controllers, parts in cgroup_paths(proc_cgroup):
        if controllers == "":
            version, bases = 2, [mount, os.path.join(mount, "unified")]
        elif "memory" in controllers.split(","):
            version, bases = 1, list(dict.fromkeys([os.path.join(mount, "memory"), os.path.join(mount, controllers)]))
        else:
            continue
        limit_name, usage_name, stat_keys = _FILES[version]
        for base in bases:
            for depth in range(len(parts), -1, -1):
                directory = os.path.join(base, *parts[:depth])
                if not os.path.isdir(directory):
                    continue
                limit_text = _read(os.path.join(directory, limit_name))
                usage = _to_int(_read(os.path.join(directory, usage_name)))
                if limit_text is None and usage is None:
                    continue  # not a cgroup here (or no memory controller on this mount)
                yield _Level(
                    version=version,
                    path="/" + "/".join(parts[:depth]),
                    limit=_limit(limit_text),
                    usage=usage,
                    reclaimable=_page_cache(_read(os.path.join(directory, "memory.stat")), stat_keys),
                )


def _limit(text: str | None) -> int | None:
    """A limit file's bytes; None for "max", the v1 near-2**63 "unlimited", and anything unreadable."""
    if text is None or text.strip() == "max":
        return None
    value = _to_int(text)
    return value if value is not None and value < _NO_LIMIT else None


def _page_cache(stat: str | None, key_sets: tuple[tuple[str, ...], ...]) -> int | None:
    """The file LRU bytes of a memory.stat, from the first key set it has in full."""
    values: dict[str, int] = {}
    for line in (stat or "").splitlines():
        fields = line.split()
        if len(fields) == 2:
            number = _to_int(fields[1])
            if number is not None:
                values[fields[0]] = number
    for keys in key_sets:
        if all(k in values for k in keys):
            return sum(values[k] for k in keys)
    return None


def _to_int(text: str | None) -> int | None:
    """A non-negative ASCII decimal, or None (kernel files hold nothing else; garbage is unknown)."""
    if text is None:
        return None
    text = text.strip(" \t\n")
    return int(text) if _DIGITS.fullmatch(text) else None


def _read(path: str, cap: int = _READ_CAP) -> str | None:
    """A small text file's contents (its first ``cap`` bytes), or None when it is missing, unreadable,
    not UTF-8 or not a file."""
    try:
        with open(path, "rb") as f:
            data = f.read(cap)
        return data.decode()
    except (OSError, UnicodeDecodeError, ValueError):
        return None
