"""How much CPU time this process may use: its CPU cgroup's quota (v1 or v2) and the budget it leaves.

A container's CPU limit (Kubernetes ``resources.limits.cpu``, ``docker run --cpus``, systemd's
``CPUQuota=``) is a CFS bandwidth quota: the cgroup may run ``quota`` microseconds of CPU time per
``period``, across all its threads and CPUs, and once that is spent the kernel stops every thread
of the cgroup until the next period. The affinity mask does not show it: a pod limited to 16 CPUs
on a 192-core node may run on all 192. Sizing pin workers from the affinity alone spends the
container's whole quota in the first milliseconds of each period and stalls the server's own
threads (measured: a 2 ms serving task's p99 at 12x its idle value under a 1-CPU quota). So
pinpool sizes its workers from :func:`cpu_budget`: the affinity, bounded by the quota.

Where the quota lives:

- cgroup v2: ``cpu.max`` holds ``"$MAX $PERIOD"`` (``"max 100000"``: no limit), in the process's
  cgroup of the unified hierarchy (``0::/path`` in ``/proc/self/cgroup``).
- cgroup v1: ``cpu.cfs_quota_us`` (``-1``: no limit) and ``cpu.cfs_period_us``, in the process's
  cgroup of the hierarchy with the ``cpu`` controller (``N:cpu,cpuacct:/path``).

A parent's quota binds its children too, so every level from the process's cgroup up to the
top of what is mounted is read, and the tightest (least CPU per period) wins. Mount points come
from ``/proc/self/mountinfo``; its root field maps a cgroup path onto the mount when a container
sees only its own subtree (a bind mount, no cgroup namespace). Without mountinfo the usual
places under ``/sys/fs/cgroup`` are tried.

Nothing here raises: a missing file or mount is "no quota known". A quota file that holds
something the kernel never writes is not guessed at: it is ignored for sizing (a pool never
refuses to start over it) but named in :attr:`CpuQuota.ignored`, which ``pinpool doctor`` shows as
a warning. ``root`` points the reader at a fixture tree laid out like ``/``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from .memlimits import _read, _to_int, cgroup_paths

__all__ = ["CpuQuota", "cpu_budget", "read_cpu_quota"]

# mountinfo lists every mount of the namespace: a node running many containers has thousands.
_MOUNTINFO_CAP = 1 << 22
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")  # mountinfo writes a space in a path as \040
V2_SOURCE = "cgroup v2 cpu.max"
V1_SOURCE = "cgroup v1 cpu.cfs_quota_us/cpu.cfs_period_us"


@dataclass(frozen=True)
class CpuQuota:
    """The CPU quota that binds this process, as read (see the module's docs).

    quota_us, period_us: CPU time the cgroup may use per period, in microseconds; both None when
        no quota applies (or none could be read).
    source: which files it came from (:data:`V2_SOURCE`, :data:`V1_SOURCE`), None without a quota.
    path: the binding cgroup's path in its hierarchy, None without a quota.
    ignored: quota files that held what the kernel never writes, each as ``"file: 'text'"``; they
        were left out of the figures above.
    """

    quota_us: int | None = None
    period_us: int | None = None
    source: str | None = None
    path: str | None = None
    ignored: tuple[str, ...] = ()

    @property
    def cpus(self) -> float | None:
        """The quota in CPUs (``quota / period``), None without one."""
        if self.quota_us is None or not self.period_us:
            return None
        return self.quota_us / self.period_us


def cpu_budget(affinity_cpus: int, quota: CpuQuota | None) -> int:
    """Threads this process can keep busy: the CPUs it may run on, bounded by the CPU time its
    cgroup may use (``floor(quota / period)``: a 1.5-CPU quota keeps one thread busy, not two);
    at least 1."""
    budget = max(1, affinity_cpus)
    cpus = None if quota is None else quota.cpus
    if cpus is not None:
        budget = min(budget, int(cpus))
    return max(1, budget)


def read_cpu_quota(root: str = "/") -> CpuQuota:
    """The tightest CPU quota on this process's cgroup path (v2 and v1), read under ``root``.
    Never raises."""
    try:
        proc_cgroup = _read(os.path.join(root, "proc/self/cgroup"))
        mounts = _cgroup_mounts(_read(os.path.join(root, "proc/self/mountinfo"), _MOUNTINFO_CAP), root)
        levels = list(_levels(proc_cgroup, mounts))
    except Exception:  # a reader must never stop a pool: an odd host reads as "unknown"  # pragma: no cover
        return CpuQuota()
    ignored = tuple(level.ignored for level in levels if level.ignored)
    limited = [level for level in levels if level.quota_us is not None]
    if not limited:
        return CpuQuota(ignored=ignored)
    tightest = min(limited, key=lambda level: (level.quota_us or 0) / level.period_us)
    return CpuQuota(tightest.quota_us, tightest.period_us, tightest.source, tightest.path, ignored)


# -- the hierarchy -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Mount:
    version: int
    directory: str  # where it is mounted, under the reader's root
    root: str  # the cgroup path the mount shows at its top (mountinfo's fourth field)


@dataclass(frozen=True)
class _Level:
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


def _levels(proc_cgroup: str | None, mounts: list[_Mount]) -> Iterator[_Level]:
    """Every cgroup on this process's path that has CPU quota files, deepest first, per mount.

    ``/proc/self/cgroup`` lines are ``id:controllers:path``: ``0::/path`` for v2,
    ``N:cpu,cpuacct:/path`` for v1. A mount whose root is not on the path (another subtree
    bind-mounted here) shows nothing of this process's cgroups and is skipped.
    """
    for controllers, parts in cgroup_paths(proc_cgroup):
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


def _read_level(version: int, directory: str, path: str) -> _Level | None:
    """One cgroup's quota; None when it has no quota files (not a cgroup, or the root of v2)."""
    if version == 2:
        name = os.path.join(directory, "cpu.max")
        text = _read(name)
        if text is None:
            return None
        fields = text.split()
        if len(fields) in (1, 2) and fields[0] == "max" and (len(fields) == 1 or _to_int(fields[1])):
            return _Level(path, V2_SOURCE, None, 1, None)
        quota, period = (_to_int(f) for f in fields) if len(fields) == 2 else (None, None)
        if quota is None or not period:
            return _Level(path, V2_SOURCE, None, 1, _shown(name, text))
        return _Level(path, V2_SOURCE, quota, period, None)
    quota_name, period_name = os.path.join(directory, "cpu.cfs_quota_us"), os.path.join(directory, "cpu.cfs_period_us")
    quota_text, period_text = _read(quota_name), _read(period_name)
    if quota_text is None and period_text is None:
        return None
    if quota_text is not None and quota_text.strip() == "-1":
        return _Level(path, V1_SOURCE, None, 1, None)
    quota, period = _to_int(quota_text), _to_int(period_text)
    if quota is None or not period:
        return _Level(path, V1_SOURCE, None, 1, f"{_shown(quota_name, quota_text)}, {_shown(period_name, period_text)}")
    return _Level(path, V1_SOURCE, quota, period, None)


def _shown(name: str, text: str | None) -> str:
    """A file and what it held, for a warning: short, and as a repr (no control characters reach a terminal)."""
    return f"{name}: {(text or '').strip()[:80]!r}"
