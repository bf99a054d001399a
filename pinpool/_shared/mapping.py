"""A region mapped in this process (:class:`SharedMapping`), made from a descriptor by creating
(under ``LOCK_EX``) or attaching (under ``LOCK_SH``): docs/shared-memory.md ("Creating atomically")."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import AllocationError, ConfigError, PoolStateError, RegionInUseError, RuntimeCallError
from .._host import libc as _libc
from .._host.giveback import checked_range, give_back
from .._units import format_bytes
from .files import remove_file
from .format import (
    FLAG_KEEP,
    FLAGS_AT,
    GENERATION_AT,
    NotRegion,
    Trailer,
    align,
    describe,
    differences,
    encode_body,
    read_field,
    read_trailer,
    region_file_bytes,
    write_field,
    write_new_trailer,
)
from .ofd import Attachers

if TYPE_CHECKING:
    import torch

    from .intents import Intents

ATTACH_WAIT_SECONDS = 5.0  # for a creation in progress (microseconds, unless the creator stopped)
_POLL_SECONDS = 0.005
_UNINITIALISED_GRACE_SECONDS = 0.5  # an empty, unlocked file: the creator may not have taken its lock yet


class Unlinker:
    """Removes the creator's file once (unless ``keep``), in the creating process, if its name still refers to it."""

    def __init__(self, dir_fd: int, name: str, identity: tuple[int, int], *, keep: bool) -> None:
        self.dir_fd = dir_fd
        self.name = name
        self.identity = identity
        self.keep = keep
        self.pid = os.getpid()
        self.done = False
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            if self.done:
                return
            self.done = True
            if os.getpid() != self.pid:
                return  # a forked child: the name and the directory descriptor are the parent's business
            try:
                if not self.keep:
                    remove_file(self.dir_fd, self.name, self.identity)
            finally:
                os.close(self.dir_fd)


# munmap holds the mmap_lock for writing while it frees: in pieces, as pinpool._host.mapping does.
_UNMAP_PIECE_BYTES = 128 << 20


def _release(base: int, file_bytes: int, fd: int, unlink: Unlinker | None, attachers: Attachers) -> None:
    for offset in range(0, file_bytes, _UNMAP_PIECE_BYTES):
        _libc.munmap(base + offset, min(_UNMAP_PIECE_BYTES, file_bytes - offset))
    attachers.close()  # unmapped: no longer one of the region's attachers
    with contextlib.suppress(OSError):
        os.close(fd)
    if unlink is not None:
        unlink()


_KEPT_FOREVER: list[SharedMapping] = []  # a chunk of them may still be registered
_kept_lock = threading.Lock()


class SharedMapping:
    """A region mapped ``MAP_SHARED``, with :class:`~pinpool._host.mapping.HostMapping`'s interface; its
    trailer's page follows the data but is read and written only with ``pread``/``pwrite`` (never SIGBUS)."""

    def __init__(
        self, *, base: int, file_bytes: int, nbytes: int, page_size: int, fd: int, path: str | None,
        created: bool, unlinker: Unlinker | None, region_id: str, attachers: Attachers,
    ) -> None:  # fmt: skip
        self.address = base
        self.length = align(nbytes, page_size)
        self.nbytes = nbytes
        self.page_size = page_size
        self.huge_pages: bool | str = "hugetlb" if page_size > _libc.PAGE_SIZE else False
        # A read fault maps up to 16 of the file's pages at once (fault-around): docs/shared-memory.md.
        self.populate_advice = _libc.MADV_POPULATE_READ
        self.fd = fd
        self.path = path
        self.created = created
        self.file_bytes = file_bytes
        self.region_id = region_id
        self._where = repr(path) if path is not None else f"fd {fd}"
        self._unlinker = unlinker
        self._intents: Intents | None = None  # made by SharedMemory.writing() when first used
        self._attachers = attachers
        self._finalizer = weakref.finalize(self, _release, base, file_bytes, fd, unlinker, attachers)
        self._finalizer.atexit = False  # never unmap at exit: the pool's finalizer may not have unpinned yet
        if unlinker is not None:
            weakref.finalize(self, unlinker)  # the name goes at exit too (atexit=True): removing it unmaps nothing

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor over ``[offset, offset+nbytes)`` of the pool's data that keeps this mapping alive."""
        import torch

        if offset < 0 or nbytes < 0 or offset + nbytes > self.length:
            raise ValueError(f"view [{offset}, +{nbytes}) outside the region's {self.length} bytes of data")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        buffer_type: Any = type("_RegionBytes", (ctypes.c_uint8 * nbytes,), {})  # a subclass can carry _owner
        buffer = buffer_type.from_address(self.address + offset)
        buffer._owner = self  # the tensor's storage holds `buffer`, `buffer` holds the mapping
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def _whole_pages(self, offset: int, nbytes: int, nothing: str) -> tuple[int, int]:
        """``[offset, +nbytes)`` of the data checked as whole pages of the file system (give_back, take_back)."""
        if self.unmapped:
            raise PoolStateError(f"shared memory {self._where} was unmapped here: there is nothing {nothing}")
        kind = "hugetlb page" if self.page_size > _libc.PAGE_SIZE else "page"
        return checked_range(
            offset, nbytes, data_bytes=self.nbytes, length=self.length, granule=self.page_size, granule_kind=kind,
            what=f"shared memory {self._where}",
        )  # fmt: skip

    def give_back(self, offset: int, nbytes: int) -> None:
        """Give ``[offset, +nbytes)`` of the data back to the host, once unpinned: a hole punched in the file
        (``MADV_REMOVE``), in whole pages of its file system, so the file's blocks fall and the range reads zero
        after; the trailer is never part of it. It can be touched and pinned again. Only while no other process
        maps the region (another pinpool mapping's pool may have these pages pinned and in use): else
        :class:`RegionInUseError`, and the pages stay in the file, untouched."""
        offset, nbytes = self._whole_pages(offset, nbytes, "left to give back")
        if nbytes == 0:
            return
        with self._attachers.alone() as alone:  # no mapping is made while the hole is punched
            if not alone:
                raise RegionInUseError(
                    f"shared memory {self._where}: [{offset}, +{nbytes}) ({format_bytes(nbytes)}) was not given "
                    "back: another process maps the region, and a hole punched in its file would pull these pages "
                    "away from it too (its pool may have them pinned and in use). They stay in the file, unpinned "
                    "here; they go back to the host once this process maps the region alone and gives them back "
                    "(grow, then shrink), or when the region is removed and its last mapping goes"
                )
            give_back(self.address, offset, nbytes, shared=True, what=f"shared memory {self._where}")

    def take_back(self, offset: int, nbytes: int) -> None:
        """Allocate ``[offset, +nbytes)`` of the file (never allocated, or given back) before anything touches
        it: a fault in a hole that a full tmpfs or an empty hugetlb pool cannot fill is a SIGBUS that kills
        the process; here it is a :class:`ConfigError` and the range stays a hole (it reads zero)."""
        offset, nbytes = self._whole_pages(offset, nbytes, "to take back")
        if nbytes == 0:
            return
        try:
            os.posix_fallocate(self.fd, offset, nbytes)
        except OSError as exc:
            hint = (
                f"free {format_bytes(self.page_size)} hugetlb pages (HugePages_Free in /proc/meminfo)"
                if self.page_size > _libc.PAGE_SIZE
                else "room on its file system (df)"
            )
            raise ConfigError(
                f"shared memory {self._where}: allocating [{offset}, +{nbytes}) ({format_bytes(nbytes)}) of its file "
                f"failed: the file system could not allocate it ({exc.strerror or exc}); nothing of it is pinned, "
                f"and it stays a hole (it reads zero). It needs {hint}: make room, or grow by less"
            ) from None

    def keep_forever(self) -> None:
        """Never unmap: part of this memory may still be registered (the name still goes at exit)."""
        with _kept_lock:
            _KEPT_FOREVER.append(self)

    @property
    def unmapped(self) -> bool:
        return not self._finalizer.alive

    def _check_mapped(self) -> None:
        if self.unmapped:
            raise PoolStateError("the shared memory region was unmapped: its generation cannot be read here")

    @property
    def populate(self) -> Callable[[int, int], None]:
        """A pool's populate step for this region (holding its figures, not the mapping)."""
        return functools.partial(_populate, self.fd, self.file_bytes, self._where, self.populate_advice)

    def check_size(self) -> None:
        """:class:`ConfigError` when another process truncated or resized the file under this mapping."""
        self._check_mapped()
        read_field(self.fd, self.file_bytes, 0, 0, self._where)

    @property
    def generation(self) -> int:
        """The region's generation number, read from the file's trailer (all processes see one value)."""
        self._check_mapped()
        return int.from_bytes(read_field(self.fd, self.file_bytes, GENERATION_AT, 8, self._where), "little")

    def set_generation(self, value: int) -> None:
        """Store ``value`` (checked by SharedMemory) as the region's generation: one aligned 8-byte write."""
        self._check_mapped()
        self._write(GENERATION_AT, value.to_bytes(8, "little"))

    def _set_keep_flag(self, keep: bool) -> None:
        if not self.unmapped:
            flags = int.from_bytes(read_field(self.fd, self.file_bytes, FLAGS_AT, 4, self._where), "little")
            flags = (flags | FLAG_KEEP) if keep else (flags & ~FLAG_KEEP)
            self._write(FLAGS_AT, flags.to_bytes(4, "little"))

    def _write(self, at: int, data: bytes) -> None:
        write_field(self.fd, self.file_bytes, at, data, self._where, page_size=self.page_size)

    def __repr__(self) -> str:
        where = self.path or f"fd {self.fd}"
        state = "unmapped" if self.unmapped else f"at {self.address:#x}"
        return f"<SharedMapping {where} {format_bytes(self.nbytes)} {state}>"


def _populate(fd: int, file_bytes: int, where: str, advice: int, ptr: int, nbytes: int) -> None:
    """Pre-fault ``[ptr, +nbytes)``; a fault refused because the file was truncated says so."""
    from .._host.mapping import populate_range  # loads torch: only once a pool pins

    try:
        populate_range(ptr, nbytes, advice)
    except RuntimeCallError as exc:
        try:
            read_field(fd, file_bytes, 0, 0, where)
        except (ConfigError, OSError) as truncated:
            raise RuntimeCallError(
                op=exc.op, code=exc.code, reason=exc.reason, ptr=ptr, nbytes=nbytes, message=str(truncated)
            ) from None
        raise


# -- making one from a descriptor -------------------------------------------------------------------

_MAKE_ROOM = (
    "Remove regions no longer used (`pinpool doctor` lists them), make the pool smaller, or enlarge the mount "
    "(`mount -o remount,size=...`)"
)


def _check_room(fd: int, needed: int, where: str, *, page_size: int, directory: str) -> None:
    """On tmpfs, a fault past the file system's size kills the process (SIGBUS): refuse first."""
    if page_size > _libc.PAGE_SIZE or needed <= 0:
        return  # hugetlbfs reserves the pages when mapping, and says ENOMEM then
    try:
        vfs = os.fstatvfs(fd)
    except OSError:
        return
    if vfs.f_blocks == 0:
        return  # no size limit (the memfd mount)
    free = vfs.f_bavail * vfs.f_frsize
    if needed > free:
        raise ConfigError(
            f"shared memory {where}: the file system ({directory or where}) has {format_bytes(free)} free of "
            f"{format_bytes(vfs.f_blocks * vfs.f_frsize)}, the region needs {format_bytes(needed)} more; a page "
            f"fault past its size would kill the process (SIGBUS). {_MAKE_ROOM}"
        )


def _map(fd: int, file_bytes: int, where: str, *, page_size: int) -> int:
    address, err = _libc.mmap_shared(file_bytes, fd)
    if err:
        if err == errno.EACCES:
            raise ConfigError(
                f"shared memory {where} cannot be mapped for writing (EACCES): the descriptor must be open for "
                "reading and writing"
            )
        hint = (
            f"; reserve more {format_bytes(page_size)} hugetlb pages (HugePages_Free in /proc/meminfo)"
            if page_size > _libc.PAGE_SIZE and err == errno.ENOMEM
            else ""
        )
        raise AllocationError(
            f"mmap of shared memory {where} ({format_bytes(file_bytes)}) failed: {_libc.errno_name(err)} "
            f"({os.strerror(err)}){hint}"
        )
    return address


def whole_pages(ranges: Sequence[tuple[int, int]], page_size: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` ranges of a file rounded out to whole pages, sorted and merged."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted((offset // page_size * page_size, align(offset + n, page_size)) for offset, n in ranges):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        elif hi > lo:
            merged.append((lo, hi))
    return [(lo, hi - lo) for lo, hi in merged]


def _attach_and_map(fd: int, file_bytes: int, where: str, *, page_size: int) -> tuple[Attachers, int]:
    """Marked an attacher first (waiting for a hole being punched in another process), then mapped: a give-back
    elsewhere never punches pages this mapping may pin."""
    attachers = Attachers(fd, where)
    try:
        return attachers, _map(fd, file_bytes, where, page_size=page_size)
    except BaseException:
        attachers.close()
        raise


def reserve_pages(
    fd: int, file_bytes: int, where: str, *, page_size: int, directory: str,
    ranges: Sequence[tuple[int, int]] | None = None,
) -> None:  # fmt: skip
    """Allocate the pages now on a size-limited tmpfs (``ranges``: those ``(offset, nbytes)`` of the file, in
    whole pages; None: all of it): a full one is a ConfigError, never a later SIGBUS."""
    if page_size > _libc.PAGE_SIZE or os.fstatvfs(fd).f_blocks == 0:
        return
    ranges = [(0, file_bytes)] if ranges is None else whole_pages(ranges, page_size)
    try:
        for offset, nbytes in ranges:
            os.posix_fallocate(fd, offset, nbytes)
    except OSError as exc:
        raise ConfigError(
            f"shared memory {where}: the file system ({directory or where}) could not reserve the region's "
            f"{format_bytes(sum(n for _, n in ranges))} ({exc.strerror or exc}); nothing was pinned. {_MAKE_ROOM}"
        ) from None


def create_mapping(
    fd: int, nbytes: int, record_json: str, where: str, *, page_size: int, keep: bool, seal: bool,
    path: str | None, directory: str, unlinker: Callable[[], Unlinker] | None,
    publish: Callable[[], None] | None = None, allocate: Sequence[tuple[int, int]] | None = None,
) -> SharedMapping:  # fmt: skip
    """Under LOCK_EX: size a new (empty) file, reserve its pages (``allocate``: only those ``(offset, nbytes)``
    of the data, and the trailer's page; None: all), write its trailer, ``publish`` it (link it into place);
    then map it. ``seal``: a memfd. ``directory``: for messages ("" for an fd)."""
    body = encode_body(nbytes, page_size, record_json)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise ConfigError(f"shared memory {where} is locked by another process: being created, or in use") from None
    st = os.fstat(fd)
    if st.st_size:
        raise ConfigError(
            f"shared memory {where} holds {format_bytes(st.st_size)} already: create=True makes a region only "
            "in an empty file; attach to it with create=False"
        )
    file_bytes = region_file_bytes(nbytes, page_size)
    # An elastic pool's file holds what its floor pins: each segment is allocated as it grows (Elastic._take_back).
    reserved = None if allocate is None else whole_pages([*allocate, (file_bytes - page_size, page_size)], page_size)
    needed = file_bytes if reserved is None else sum(n for _, n in reserved)
    _check_room(fd, needed, where, page_size=page_size, directory=directory)
    try:
        os.ftruncate(fd, file_bytes)
    except OSError as exc:
        hint = " (check the hugetlbfs mount's size= limit)" if page_size > _libc.PAGE_SIZE else ""
        raise ConfigError(
            f"shared memory {where} cannot be sized to {format_bytes(file_bytes)}: {exc.strerror or exc}{hint}"
        ) from None
    reserve_pages(fd, file_bytes, where, page_size=page_size, directory=directory, ranges=reserved)
    write_new_trailer(fd, file_bytes, body, where, keep=keep, page_size=page_size)
    if seal:  # nobody shrinks a memfd under the mappings (SIGBUS); a kernel without sealing: documented
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    if publish is not None:
        publish()
    # A named region stays LOCK_SH while mapped: doctor tells a region in use from an orphan (a dead
    # process's lock is gone with it). A descriptor handed on shares its open file with the caller's: unlocked.
    fcntl.flock(fd, fcntl.LOCK_SH if path is not None else fcntl.LOCK_UN)
    attachers, address = _attach_and_map(fd, file_bytes, where, page_size=page_size)
    return SharedMapping(
        base=address, file_bytes=file_bytes, nbytes=nbytes, page_size=page_size, fd=fd,
        path=path, created=True, unlinker=None if unlinker is None else unlinker(),
        region_id=read_trailer(fd, file_bytes).region_id, attachers=attachers,
    )  # fmt: skip


def _locked_trailer(fd: int, where: str, *, hold: bool) -> tuple[os.stat_result, Trailer]:
    """The trailer, read under LOCK_SH once no creation is in progress; :class:`ConfigError` for no region.
    ``hold``: the lock stays taken on success (a named region's mapping holds it while mapped)."""
    deadline = time.monotonic() + ATTACH_WAIT_SECONDS
    first_empty: float | None = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"shared memory {where} stayed locked for {ATTACH_WAIT_SECONDS:g} s: its creator is stopped "
                    "while creating it, or another program holds a lock on it"
                ) from None
            time.sleep(_POLL_SECONDS)
            continue
        held = False
        try:
            st = os.fstat(fd)
            if hold and st.st_nlink == 0:  # its creator, or `doctor --remove-stale` (an orphan), removed it meanwhile
                raise ConfigError(
                    f"shared memory file {where} was removed while being opened; create it again or retry"
                )
            found = st, read_trailer(fd, st.st_size)
            held = hold
            return found
        except NotRegion as exc:
            now = time.monotonic()
            first_empty = now if first_empty is None else first_empty
            if not exc.uninitialised or now - first_empty > _UNINITIALISED_GRACE_SECONDS or now > deadline:
                fix = (
                    "its creator died while creating it, or it is not a region: remove it (`rm` it) and create it "
                    "again" if exc.uninitialised else
                    "attach only to a file pinpool created (create=True makes one); remove it if it is left over"
                )  # fmt: skip
                raise ConfigError(f"shared memory {where} {exc.problem}; {fix}") from None
        finally:
            if not held:
                fcntl.flock(fd, fcntl.LOCK_UN)
        time.sleep(_POLL_SECONDS)


def attach_mapping(
    fd: int, nbytes: int, record_json: str, where: str, *, page_size: int, path: str | None, directory: str,
    unlinker: Callable[[], Unlinker] | None, allocate: Sequence[tuple[int, int]] | None = None,
) -> SharedMapping:  # fmt: skip
    """Map the region the file holds once its trailer matches ``nbytes``, ``record_json`` and ``page_size``;
    ``allocate``: the ``(offset, nbytes)`` of the data this pool pins first, allocated in the file now (None:
    the whole file must fit its file system)."""
    st, trailer = _locked_trailer(fd, where, hold=path is not None)  # the caller closes fd on failure
    if trailer.page_size != page_size:
        raise ConfigError(
            f"shared memory {where} was made of {format_bytes(trailer.page_size)} pages, but its file system has "
            f"{format_bytes(page_size)} pages: it was copied or moved; remove it and create it again"
        )
    expected = region_file_bytes(trailer.nbytes, trailer.page_size)
    if st.st_size != expected:
        raise ConfigError(
            f"shared memory {where} is {st.st_size} bytes, but its trailer says it holds "
            f"{format_bytes(trailer.nbytes)} ({expected} bytes of file): it was truncated or grown by something "
            "else than pinpool; remove it and create it again"
        )
    asked = json.loads(record_json)
    if trailer.nbytes != nbytes or trailer.record != asked:
        raise ConfigError(
            f"shared memory {where} holds {describe(trailer.nbytes, trailer.record)}, but the pool asks for "
            f"{describe(nbytes, asked)}: {differences(trailer.nbytes, trailer.record, nbytes, asked)}. A "
            "region is attached only with the layout and size it was made with: give the pool those, or "
            "remove the region (`rm` it) and create it again"
        )
    file_bytes = st.st_size
    if allocate is None:
        _check_room(fd, file_bytes - st.st_blocks * 512, where, page_size=page_size, directory=directory)
    else:  # pages a creator never grew (or gave back) are holes: those this pool pins at entry are allocated now
        reserve_pages(fd, file_bytes, where, page_size=page_size, directory=directory, ranges=allocate)
    attachers, address = _attach_and_map(fd, file_bytes, where, page_size=page_size)
    return SharedMapping(
        base=address, file_bytes=file_bytes, nbytes=nbytes, page_size=page_size, fd=fd, path=path,
        created=unlinker is not None, unlinker=None if unlinker is None else unlinker(), region_id=trailer.region_id,
        attachers=attachers,
    )  # fmt: skip
