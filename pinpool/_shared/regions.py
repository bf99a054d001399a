"""Finding and reading shared memory regions without mapping them: :class:`RegionInfo` (what a
region file holds, from its trailer and its ``stat``), :func:`read_region` (one file),
:func:`find_regions` (every region in ``/dev/shm`` and the hugetlbfs mounts, for ``pinpool
doctor``). Nothing here raises for a bad file, follows a symbolic link or blocks on a FIFO.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .._host.files import FILE_FLAGS
from .trailer import FLAG_KEEP, TRAILER_BYTES, _NotRegion, _process_start, _read_trailer, _Trailer

__all__ = [
    "HalfMade",
    "RegionInfo",
    "find_half_made",
    "find_regions",
    "is_temp_name",
    "read_region",
    "region_directories",
]

_SCAN_LIMIT = 1_000_000  # directory entries find_regions looks at, at most (an lstat each, at worst)
_TEMP_MARK = ".pinpool-new-"  # in the temporary name a region is made under (see _shared_files)


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a region being made (or left half-made by a creator that died)."""
    return name.startswith(".") and _TEMP_MARK in name


@dataclass(frozen=True)
class RegionInfo:
    """What a region file holds, read from its trailer and its ``stat``.

    ``held_bytes``: memory the file holds now (``st_blocks * 512``: resident, or swapped out on
    tmpfs), trailer included. ``creator_alive``: whether the creating process still runs (its
    pid with the same start time, on this host); ``None`` when it was made on another host (a
    container with its own hostname) and so cannot be told.
    """

    path: str
    file_bytes: int
    nbytes: int
    page_size: int
    held_bytes: int
    owner_uid: int
    version: int
    generation: int
    region_id: str
    keep: bool
    record: Mapping[str, Any]
    created_uid: int | None
    created_pid: int | None
    created_unix: float | None
    created_host: str | None
    creator_alive: bool | None
    age_seconds: float | None


def _region_info(path: str, st: os.stat_result, trailer: _Trailer) -> RegionInfo:
    created = trailer.created
    pid, host, start = created.get("pid"), created.get("host"), created.get("start")
    alive: bool | None = None
    if isinstance(pid, int) and host == socket.gethostname():
        alive = start is not None and _process_start(pid) == start
    unix = created.get("unix")
    when = float(unix) if isinstance(unix, int | float) else None
    return RegionInfo(
        path=path, file_bytes=st.st_size, nbytes=trailer.nbytes, page_size=trailer.page_size,
        held_bytes=st.st_blocks * 512, owner_uid=st.st_uid, version=trailer.version, generation=trailer.generation,
        region_id=trailer.region_id, keep=bool(trailer.flags & FLAG_KEEP), record=trailer.record,
        created_uid=created.get("uid") if isinstance(created.get("uid"), int) else None,
        created_pid=pid if isinstance(pid, int) else None, created_unix=when,
        created_host=host if isinstance(host, str) else None, creator_alive=alive,
        age_seconds=None if when is None else max(0.0, time.time() - when),
    )  # fmt: skip


def read_region(path: str, *, dir_fd: int | None = None) -> RegionInfo | None:
    """What the file at ``path`` holds (with ``dir_fd``: its name in that open directory), or
    None when it is no pinpool region (or cannot be read). Never follows a symbolic link as its
    last component, never blocks on a FIFO, never raises for a bad file."""
    name = path if dir_fd is None else os.path.basename(path)
    try:
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return None
        fd = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        return _region_info(path, st, _read_trailer(fd, st.st_size))
    except (OSError, _NotRegion):
        return None
    finally:
        os.close(fd)


def region_directories(mounts: str = "/proc/mounts") -> list[str]:
    """Where regions live: ``/dev/shm`` and every hugetlbfs mount point."""
    found = ["/dev/shm"]
    try:
        with open(mounts) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "hugetlbfs":
                    point = parts[1].replace("\\040", " ")
                    if point not in found:
                        found.append(point)
    except OSError:
        pass
    return found


@dataclass(frozen=True)
class HalfMade:
    """A region's temporary file (``.NAME.pinpool-new-*``): ``in_progress`` while its creator
    holds its lock, else left by a creator that died, holding ``held_bytes`` of memory until
    removed (the next creation of that name removes it)."""

    path: str
    held_bytes: int
    in_progress: bool


def _files(directories: Iterable[str] | None) -> Iterator[os.DirEntry[str]]:
    """Regular files in ``directories`` (default :func:`region_directories`) and their immediate
    subdirectories, never through a link; at most :data:`_SCAN_LIMIT` entries looked at in all."""
    budget = _SCAN_LIMIT
    pending = [(d, 1) for d in (region_directories() if directories is None else directories)]
    while pending and budget > 0:
        directory, depth = pending.pop(0)
        try:
            scan = os.scandir(directory)
        except OSError:
            continue
        with scan:
            for entry in scan:
                budget -= 1
                if budget < 0:
                    break
                try:
                    if entry.is_dir(follow_symlinks=False):
                        if depth > 0:
                            pending.append((entry.path, depth - 1))
                    elif entry.is_file(follow_symlinks=False):
                        yield entry
                except OSError:
                    continue


def find_regions(directories: Iterable[str] | None = None) -> list[RegionInfo]:
    """Every pinpool region in ``directories`` (default :func:`region_directories`) and in their
    immediate subdirectories, by path; files that are not regions, or cannot be read, are skipped.

    Bounded per file, not by how many entries come first: a file too small to hold a trailer is
    skipped on its ``lstat`` alone (10,000 empty files planted to sort first hide nothing), a
    larger one costs one 4 KiB ``pread`` and a bounded parse; at most :data:`_SCAN_LIMIT`
    entries are looked at in all. Regions being made (their temporary names) are
    :func:`find_half_made`'s."""
    regions: list[RegionInfo] = []
    for entry in _files(directories):
        try:
            if is_temp_name(entry.name) or entry.stat(follow_symlinks=False).st_size < 2 * TRAILER_BYTES:
                continue
        except OSError:
            continue
        info = read_region(entry.path)
        if info is not None:
            regions.append(info)
    return sorted(regions, key=lambda r: r.path)


def find_half_made(directories: Iterable[str] | None = None) -> list[HalfMade]:
    """Every region's temporary file in ``directories``, as :func:`find_regions` looks: being
    made now (its creator holds ``LOCK_EX``), or left by a creator that died."""
    found: list[HalfMade] = []
    for entry in _files(directories):
        if not is_temp_name(entry.name):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | FILE_FLAGS)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                busy = False
            except BlockingIOError:
                busy = True
            found.append(HalfMade(entry.path, os.fstat(fd).st_blocks * 512, busy))
        except OSError:
            continue
        finally:
            os.close(fd)
    return sorted(found, key=lambda h: h.path)
