"""Reading memory pressure once (:func:`read_memory_pressure`): PSI, the binding memory cgroup's usage
against its limit and ``memory.high`` (v1: soft limit), and MemAvailable, as one :class:`MemoryReading`
an elastic policy decides from. The cgroup is found as :mod:`.limits` finds it.

Unlike :mod:`.limits`, whose pre-flight must never stop a pool, a policy that acts on garbage gives
memory back (or takes it) for nothing: a file that exists but holds what the kernel never writes raises
:class:`~pinpool.PressureError` naming the file and its text. An absent or unreadable file is not an
error: its figure is ``None`` (no PSI in this kernel, no memory controller, no limit).
"""

from __future__ import annotations

import os
import re

from .._errors import PressureError
from .._types import MemoryReading, PsiLine, PsiReading
from .limits import _FILES, _NO_LIMIT, _page_cache, _to_int, binding_memory_cgroup, v2_cgroup_directories

__all__ = [
    "PROC_PSI",
    "MemoryReading",
    "PressureError",
    "PsiLine",
    "PsiReading",
    "parse_limit",
    "parse_meminfo",
    "parse_psi",
    "psi_file",
    "read_memory_pressure",
]

PROC_PSI = "proc/pressure/memory"  # under the reader's root
_READ_CAP = 1 << 16  # every file read here is a few hundred bytes
_SHOWN = 120  # characters of a bad file's text kept in an error
# "some avg10=0.00 avg60=0.00 avg300=0.00 total=0": the kernel prints exactly this shape.
_PSI_LINE = re.compile(
    r"(some|full) avg10=([0-9]{1,3}\.[0-9]{2}) avg60=([0-9]{1,3}\.[0-9]{2}) avg300=([0-9]{1,3}\.[0-9]{2}) "
    r"total=([0-9]{1,20})",
    re.ASCII,
)
# v1 names the soft limit where v2 has memory.high: both are where reclaim starts before the hard limit.
_HIGH = {2: "memory.high", 1: "memory.soft_limit_in_bytes"}


def _bad(path: str, text: str, what: str) -> PressureError:
    shown = repr(text.strip()[:_SHOWN])
    return PressureError(
        f"{path} holds {shown}, not {what}: the kernel never writes that, so the pressure reading cannot be "
        "trusted; check what is mounted there (a container runtime's fake /proc or /sys?) or stop reading "
        "pressure from it (elastic=False)",
        path=path,
        value=shown,
    )


def parse_psi(text: str, path: str) -> PsiReading:
    """A PSI file's text (``some`` line, then ``full`` on kernels since 5.13 for every resource but CPU)."""
    lines: dict[str, PsiLine] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        match = _PSI_LINE.fullmatch(line.strip())
        if match is None or match.group(1) in lines:
            raise _bad(path, text, "PSI lines ('some avg10=... avg60=... avg300=... total=...')")
        kind, avg10, avg60, avg300, total = match.groups()
        lines[kind] = PsiLine(float(avg10), float(avg60), float(avg300), int(total))
    if "some" not in lines:
        raise _bad(path, text, "PSI lines (no 'some' line)")
    return PsiReading(source=path, some=lines["some"], full=lines.get("full"))


def parse_limit(text: str, path: str) -> int | None:
    """A cgroup byte figure (usage, limit, memory.high, soft limit): None for no limit (v2 ``max``; v1's
    PAGE_COUNTER_MAX, 9223372036854771712 with 4 KiB pages)."""
    stripped = text.strip(" \t\n")
    if stripped == "max":
        return None
    value = _to_int(stripped)
    if value is None:
        raise _bad(path, text, "a byte count or 'max'")
    return None if value >= _NO_LIMIT else value


def parse_meminfo(text: str, path: str) -> tuple[int | None, int | None]:
    """``MemAvailable`` and ``MemTotal`` in bytes; None for a key the kernel does not write (MemAvailable
    before 3.14)."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if key not in ("MemAvailable", "MemTotal"):
            continue
        fields = rest.split()
        kib = _to_int(fields[0]) if sep and len(fields) == 2 and fields[1] == "kB" else None
        if kib is None:
            raise _bad(path, line, f"'{key}: <n> kB'")
        found[key] = kib * 1024
    return found.get("MemAvailable"), found.get("MemTotal")


def _text(path: str) -> str | None:
    """A small kernel file's text; None when it is absent or cannot be read (no PSI: EOPNOTSUPP)."""
    try:
        with open(path, "rb") as f:
            data = f.read(_READ_CAP)
    except OSError:
        return None
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise _bad(path, data.decode("ascii", "replace"), "ASCII text") from None


def psi_file(root: str = "/") -> str | None:
    """The memory PSI file for this process: its cgroup v2 ``memory.pressure`` (the deepest level that
    has one: the stall of this cgroup's tasks), else the system-wide file, else None (no PSI)."""
    candidates = [os.path.join(directory, "memory.pressure") for _, directory in v2_cgroup_directories(root)]
    for path in [*candidates, os.path.join(root, PROC_PSI)]:
        if os.path.isfile(path) and _text(path) is not None:
            return path
    return None


def read_memory_pressure(root: str = "/") -> MemoryReading:
    """One reading of this process's memory pressure, under ``root`` (a fixture tree, or ``/``)."""
    source = psi_file(root)
    text = None if source is None else _text(source)
    psi = None if source is None or text is None else parse_psi(text, source)
    meminfo_path = os.path.join(root, "proc/meminfo")
    meminfo = _text(meminfo_path)
    available, total = (None, None) if meminfo is None else parse_meminfo(meminfo, meminfo_path)
    cgroup = binding_memory_cgroup(root)
    if cgroup is None:
        return MemoryReading(psi=psi, mem_available_bytes=available, mem_total_bytes=total)
    version, path, directory = cgroup
    limit_name, usage_name, stat_keys = _FILES[version]
    figures = {}
    for name in (usage_name, limit_name, _HIGH[version]):
        file = os.path.join(directory, name)
        content = _text(file)
        figures[name] = None if content is None else parse_limit(content, file)
    return MemoryReading(
        psi=psi,
        cgroup_version=version,
        cgroup_path=path,
        usage_bytes=figures[usage_name],
        limit_bytes=figures[limit_name],
        high_bytes=figures[_HIGH[version]],
        reclaimable_bytes=_page_cache(_text(os.path.join(directory, "memory.stat")), stat_keys),
        mem_available_bytes=available,
        mem_total_bytes=total,
    )
