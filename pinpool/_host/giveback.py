"""Giving a pool's pages back to the host once they are unpinned: unpinning alone frees nothing, the pages
stay resident and charged to the memory cgroup until they are dropped (docs/concepts.md).

Private memory is dropped with ``MADV_DONTNEED``; a shared mapping's file gets a hole punched in it with
``MADV_REMOVE`` (``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)`` through the mapping), since a
shared mapping's ``MADV_DONTNEED`` drops only this process's view and the file keeps the pages. Both are
refused by the kernel (EINVAL) over pages this process still holds with ``mlock``, which turns "gave back
a pinned page" into an error instead of a silent unpin; a GPU registration is not seen by the kernel that
way, so the caller unregisters first. The range reads zero afterwards and can be touched and pinned again.

:func:`checked_range` is the pure part (which ranges may be given back); :func:`give_back` makes the call.
"""

from __future__ import annotations

import errno
import os

from .._errors import ConfigError, PoolStateError, RuntimeCallError
from .._units import format_bytes, shown
from . import libc as _libc

GRANULE_WHY = {
    "page": "the OS page",
    "huge page": "a transparent huge page: a part of one is split off and freed only later, under pressure",
    "hugetlb page": "a hugetlb page, which the kernel frees only whole",
}


def checked_range(
    offset: object, nbytes: object, *, data_bytes: int, length: int, granule: int, granule_kind: str, what: str
) -> tuple[int, int]:
    """``(offset, nbytes)`` to drop, in whole ``granule`` pages inside the mapping's ``length`` bytes.
    A range that ends at the data's end (``data_bytes``, the pool's last byte) takes the padding to the
    mapping's end with it; ``nbytes == 0`` drops nothing. :class:`ConfigError` for anything else."""
    call = f"{what}.give_back(offset={shown(offset)}, nbytes={shown(nbytes)})"
    for name, value in (("offset", offset), ("nbytes", nbytes)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{call}: {name} must be an int number of bytes, not {type(value).__name__}")
    assert isinstance(offset, int) and isinstance(nbytes, int)
    if offset < 0 or nbytes < 0:
        raise ConfigError(f"{call}: offset and nbytes are byte counts >= 0")
    end = offset + nbytes
    if end > length:
        raise ConfigError(
            f"{call}: the range ends at byte {end}, past the memory's {data_bytes} B ({length} B mapped); give "
            "back a range inside it"
        )
    if nbytes == 0:
        return offset, 0
    if end == data_bytes:
        end = length  # the padding after the last byte is the mapping's own: it goes with the last page
    why = GRANULE_WHY[granule_kind]
    if offset % granule or end % granule:
        edge, value = ("offset", offset) if offset % granule else ("end (offset + nbytes)", end)
        lo, hi = -(-offset // granule) * granule, end // granule * granule
        fix = (
            f"give back [{lo}, +{hi - lo}) instead (the whole pages inside the range)"
            if hi > lo
            else "the range holds no whole page: give back a larger one"
        )
        raise ConfigError(
            f"{call}: the {edge} {value} is not a multiple of {format_bytes(granule)} ({why}); only whole pages can "
            f"be given back to the host; {fix}"
        )
    return offset, end - offset


def give_back(address: int, offset: int, nbytes: int, *, shared: bool, what: str) -> None:
    """Drop ``[address + offset, +nbytes)`` (checked by :func:`checked_range`): ``MADV_REMOVE`` for a
    shared mapping, ``MADV_DONTNEED`` for private memory."""
    if nbytes == 0:
        return
    advice, name = (_libc.MADV_REMOVE, "MADV_REMOVE") if shared else (_libc.MADV_DONTNEED, "MADV_DONTNEED")
    err = _libc.madvise(address + offset, nbytes, advice)
    if not err:
        return
    where = f"{what}: giving back [{offset}, +{nbytes}) ({format_bytes(nbytes)})"
    if err == errno.EINVAL:
        raise PoolStateError(
            f"{where}: madvise({name}) refused it (EINVAL): part of the range is still locked (mlock) in this "
            "process, and the kernel keeps locked pages; unpin the range first, then give it back"
        )
    if err == errno.EACCES and shared:
        raise ConfigError(
            f"{where}: madvise({name}) refused it (EACCES): the region is mapped read-only here, and only a "
            "writable mapping may punch holes in its file; give it back from a process that maps it for writing"
        )
    raise RuntimeCallError(
        op=f"madvise({name})", code=err, reason=_libc.errno_name(err), ptr=address + offset, nbytes=nbytes,
        message=f"{os.strerror(err)}: {where} failed; the pages stay resident (they are unpinned already)",
    )  # fmt: skip
