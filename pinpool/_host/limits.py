"""What this process's cgroups (v1 or v2) leave it: memory that may still become resident (pinning
past it gets the process OOM-killed, not a rollback), and CPU time (a CFS quota the affinity mask
does not show: docs/operations.md, "Sizing workers"). Every level from the process's cgroup up is
read, the tightest wins; best effort: a missing or garbage file reads as ``None`` and nothing raises.
``root`` points a reader at a fixture tree.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from .._types import CpuQuota, cgroup_room

# The kernel reports "no limit" as PAGE_COUNTER_MAX pages (v1: 9223372036854771712 with 4 KiB
# pages; v2 writes "max"). Anything this large is no limit at all.
_NO_LIMIT = 1 << 62
# Every file read here is a few KiB; a cap keeps a garbage fixture (or /dev/zero) from costing more.
_READ_CAP = 1 << 16
_PATH_MAX = 4096  # the kernel never writes a longer cgroup path
_DIGITS = re.compile(r"[0-9]{1,20}", re.ASCII)  # int() would also take "1_0", "+1", " ١٠ "


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class MemoryLimits:
    """This process's memory figures in bytes, ``None`` where unknown (the limit: or unlimited); the cgroup
    figures are of the cgroup or ancestor with the least room left. ``mem_available_bytes`` is host-wide."""

    cgroup_version: int | None = None
    cgroup_limit_bytes: int | None = None
    cgroup_usage_bytes: int | None = None
    mem_available_bytes: int | None = None
    cgroup_path: str | None = None
    cgroup_reclaimable_bytes: int | None = None


def read_memory_limits(root: str = "/") -> MemoryLimits:
    try:
        level = _binding_level(_read(os.path.join(root, "proc/self/cgroup")), os.path.join(root, "sys/fs/cgroup"))
        available = read_mem_available(os.path.join(root, "proc/meminfo"))
    except Exception:  # a reader must never stop a pool: an odd host reads as "unknown"  # pragma: no cover
        return MemoryLimits()
    if level is None:
        return MemoryLimits(mem_available_bytes=available)
    return MemoryLimits(
        cgroup_version=level.version,
        cgroup_limit_bytes=level.limit,
        cgroup_usage_bytes=level.usage,
        mem_available_bytes=available,
        cgroup_path=level.path,
        cgroup_reclaimable_bytes=level.reclaimable,
    )


def read_mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes, or None (a kernel before 3.14 has none; garbage reads as None)."""
    for line in (_read(meminfo) or "").splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            kib = _to_int(fields[1]) if len(fields) == 3 and fields[2] == "kB" else None
            return None if kib is None else kib * 1024
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
    directory: str = ""  # where its files are, under the reader's root


# Per version: the limit, usage and stat files, and the memory.stat keys of the file LRU lists
# (v1 has hierarchical total_* keys, which count child cgroups as usage_in_bytes does).
_FILES = {
    2: ("memory.max", "memory.current", (("active_file", "inactive_file"),)),
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes",
        (("total_active_file", "total_inactive_file"), ("active_file", "inactive_file"))),
}  # fmt: skip


def _binding_level(proc_cgroup: str | None, mount: str) -> _Level | None:
    """The cgroup whose limit leaves the least room, else the process's own cgroup, else None."""
    levels = list(_levels(proc_cgroup, mount))
    limited = [level for level in levels if level.limit is not None]
    if limited:
        return min(limited, key=lambda level: cgroup_room(level.limit, level.usage, level.reclaimable) or 0)
    return levels[0] if levels else None


def _cgroup_paths(proc_cgroup: str | None) -> Iterator[tuple[str, list[str]]]:
    """Each ``id:controllers:path`` line of ``/proc/self/cgroup`` as its controllers ("" for v2) and
    path parts; skipped: a path outside this cgroup namespace (``..``) or longer than the kernel writes."""
    for line in (proc_cgroup or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3 or len(fields[2]) > _PATH_MAX:
            continue
        parts = [p for p in fields[2].removesuffix(" (deleted)").split("/") if p not in ("", ".")]
        if ".." not in parts:
            yield fields[1], parts


def _levels(proc_cgroup: str | None, mount: str) -> Iterator[_Level]:
    """Every cgroup of this process that has memory files, deepest first, per hierarchy."""
    for version, path, directory in _directories(proc_cgroup, mount):
        limit_name, usage_name, stat_keys = _FILES[version]
        limit_text = _read(os.path.join(directory, limit_name))
        usage = _to_int(_read(os.path.join(directory, usage_name)))
        if limit_text is None and usage is None:
            continue  # not a cgroup here (or no memory controller on this mount)
        yield _Level(
            version=version,
            path=path,
            limit=_limit(limit_text),
            usage=usage,
            reclaimable=_page_cache(_read(os.path.join(directory, "memory.stat")), stat_keys),
            directory=directory,
        )


def _directories(proc_cgroup: str | None, mount: str) -> Iterator[tuple[int, str, str]]:
    """Each existing directory of this process's v2 cgroup and v1 memory cgroup and of their ancestors,
    deepest first, per hierarchy, as (version, cgroup path, directory); without a cgroup namespace the
    path names the host's cgroup, the container's mount root: the walk up finds its files."""
    for controllers, parts in _cgroup_paths(proc_cgroup):
        if controllers == "":
            version, bases = 2, [mount, os.path.join(mount, "unified")]
        elif "memory" in controllers.split(","):
            version, bases = 1, list(dict.fromkeys([os.path.join(mount, "memory"), os.path.join(mount, controllers)]))
        else:
            continue
        for base in bases:
            for depth in range(len(parts), -1, -1):
                directory = os.path.join(base, *parts[:depth])
                if os.path.isdir(directory):
                    yield version, "/" + "/".join(parts[:depth]), directory


def binding_memory_cgroup(root: str = "/") -> tuple[int, str, str] | None:
    """The memory cgroup :func:`read_memory_limits` reads, as (version, cgroup path, directory): the one
    whose limit leaves the least room, else the process's own; None outside any memory cgroup."""
    level = _binding_level(_read(os.path.join(root, "proc/self/cgroup")), os.path.join(root, "sys/fs/cgroup"))
    return None if level is None else (level.version, level.path, level.directory)


def v2_cgroup_directories(root: str = "/") -> list[tuple[str, str]]:
    """This process's cgroup v2 directory and its ancestors', deepest first, as (cgroup path, directory),
    whether or not the memory controller is enabled there (PSI files are kept per cgroup regardless)."""
    proc_cgroup = _read(os.path.join(root, "proc/self/cgroup"))
    found = _directories(proc_cgroup, os.path.join(root, "sys/fs/cgroup"))
    return [(path, directory) for version, path, directory in found if version == 2]


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
    """A small text file's first ``cap`` bytes, or None when missing, unreadable or not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read(cap)
        return data.decode()
    except (OSError, UnicodeDecodeError, ValueError):
        return None


# -- the CPU quota ----------------------------------------------------------------------------------

# mountinfo lists every mount of the namespace: a node running many containers has thousands.
_MOUNTINFO_CAP = 1 << 22
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")  # mountinfo writes a space in a path as \040
V2_SOURCE = "cgroup v2 cpu.max"
V1_SOURCE = "cgroup v1 cpu.cfs_quota_us/cpu.cfs_period_us"


def read_cpu_quota(root: str = "/") -> CpuQuota:
    """The tightest CPU quota on this process's cgroup path (v2 and v1), read under ``root``."""
    try:
        proc_cgroup = _read(os.path.join(root, "proc/self/cgroup"))
        mounts = _cgroup_mounts(_read(os.path.join(root, "proc/self/mountinfo"), _MOUNTINFO_CAP), root)
        levels = list(_cpu_levels(proc_cgroup, mounts))
    except Exception:  # a reader must never stop a pool: an odd host reads as "unknown"  # pragma: no cover
        return CpuQuota()
    ignored = tuple(level.ignored for level in levels if level.ignored)
    limited = [level for level in levels if level.quota_us is not None]
    if not limited:
        return CpuQuota(ignored=ignored)
    tightest = min(limited, key=lambda level: (level.quota_us or 0) / level.period_us)
    return CpuQuota(tightest.quota_us, tightest.period_us, tightest.source, tightest.path, ignored)


@dataclass(frozen=True)
class _Mount:
    version: int
    directory: str  # where it is mounted, under the reader's root
    root: str  # the cgroup path the mount shows at its top (mountinfo's fourth field)


@dataclass(frozen=True)
class _CpuLevel:
    path: str
    source: str
    quota_us: int | None
    period_us: int
    ignored: str | None


def _cgroup_mounts(mountinfo: str | None, root: str) -> list[_Mount]:
    """The cgroup2 mounts and the v1 mounts holding the ``cpu`` controller, from mountinfo; the
    usual places when mountinfo is missing or lists none."""
    found: list[_Mount] = []
    for line in (mountinfo or "").splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            version = 2
        elif fstype == "cgroup" and "cpu" in options:
            version = 1
        else:
            continue
        mount_root, mount_point = (_OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), f) for f in fields[3:5])
        found.append(_Mount(version, os.path.join(root, mount_point.lstrip("/")), mount_root))
    if found:
        return found
    base = os.path.join(root, "sys/fs/cgroup")
    return [
        _Mount(2, base, "/"),
        _Mount(2, os.path.join(base, "unified"), "/"),
        _Mount(1, os.path.join(base, "cpu"), "/"),
        _Mount(1, os.path.join(base, "cpu,cpuacct"), "/"),
    ]


def _cpu_levels(proc_cgroup: str | None, mounts: list[_Mount]) -> Iterator[_CpuLevel]:
    """Every cgroup on this process's path that has CPU quota files, deepest first, per mount; a mount
    whose root is not on the path (another subtree bind-mounted here) is skipped."""
    for controllers, parts in _cgroup_paths(proc_cgroup):
        version = 2 if controllers == "" else 1 if "cpu" in controllers.split(",") else None
        if version is None:
            continue
        for mount in (m for m in mounts if m.version == version):
            top = [p for p in mount.root.split("/") if p]
            if parts[: len(top)] != top:
                continue
            for depth in range(len(parts), len(top) - 1, -1):
                directory = os.path.join(mount.directory, *parts[len(top) : depth])
                level = _read_level(version, directory, "/" + "/".join(parts[:depth]))
                if level is not None:
                    yield level


def _read_level(version: int, directory: str, path: str) -> _CpuLevel | None:
    """One cgroup's quota; None when it has no quota files (not a cgroup, or the root of v2)."""
    if version == 2:
        name = os.path.join(directory, "cpu.max")
        text = _read(name)
        if text is None:
            return None
        fields = text.split()
        if len(fields) in (1, 2) and fields[0] == "max" and (len(fields) == 1 or _to_int(fields[1])):
            return _CpuLevel(path, V2_SOURCE, None, 1, None)
        quota, period = (_to_int(f) for f in fields) if len(fields) == 2 else (None, None)
        if quota is None or not period:
            return _CpuLevel(path, V2_SOURCE, None, 1, _shown(name, text))
        return _CpuLevel(path, V2_SOURCE, quota, period, None)
    quota_name, period_name = os.path.join(directory, "cpu.cfs_quota_us"), os.path.join(directory, "cpu.cfs_period_us")
    quota_text, period_text = _read(quota_name), _read(period_name)
    if quota_text is None and period_text is None:
        return None
    if quota_text is not None and quota_text.strip() == "-1":
        return _CpuLevel(path, V1_SOURCE, None, 1, None)
    quota, period = _to_int(quota_text), _to_int(period_text)
    if quota is None or not period:
        return _CpuLevel(
            path, V1_SOURCE, None, 1, f"{_shown(quota_name, quota_text)}, {_shown(period_name, period_text)}"
        )
    return _CpuLevel(path, V1_SOURCE, quota, period, None)


def _shown(name: str, text: str | None) -> str:
    """A file and what it held, for a warning: short, and as a repr (no control characters reach a terminal)."""
    return f"{name}: {(text or '').strip()[:80]!r}"
