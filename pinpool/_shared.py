"""Shared, file-backed pool memory: a ``MAP_SHARED`` mapping of a file on tmpfs (``/dev/shm``), on
hugetlbfs (2 MiB or 1 GiB pages) or of a memfd, that several processes map and that can outlive the
process that made it (a *warm restart*).

**The file.** ``[0, data)`` holds the pool's bytes, ``data = nbytes`` rounded up to the file
system's page (4 KiB on tmpfs, the huge page on hugetlbfs); one more page follows, whose last
4 KiB are the *trailer* that says what the file holds. So the file is ``data + page_size`` bytes,
the pool's memory starts at file offset 0 (another program that maps the file sees the pool's
bytes at its start), and a pinpool region is recognised by the last 4 KiB of a file. On tmpfs the
trailer costs 4 KiB; on hugetlbfs it costs one huge page (2 MiB, or 1 GiB with 1 GiB pages: a
huge page cannot be split between a pinned range and the trailer, since ``mlock`` must split the
mapping at a huge-page boundary).

**The trailer** (little-endian; hugetlbfs files are written through a mapping, never ``write()``)::

    offset  size  field
    0       8     magic b"pinpoolR"          written last: a file without it is not (yet) a region
    8       4     format version (1)         a newer one is refused, not guessed at
    12      4     body length                bytes of the JSON body at offset 40
    16      4     CRC-32 of the body
    20      4     flags                      bit 0: the creator keeps the file (keep=True)
    24      8     generation                 the server's own counter (see below); not in the CRC
    32      8     reserved (0)
    40      ...   body: UTF-8 JSON {"nbytes", "page_size", "record", "created": {"uid", "pid",
                  "start", "unix", "host"}}; "record" is the pool's description (layout_record())

**Creating** (``create=True``): ``O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC`` (mode 0600 by
default; an existing name is a :class:`ConfigError`), ``flock(LOCK_EX)`` at once, ``ftruncate``
to the full size, map, write the trailer (magic last), ``flock(LOCK_UN)``. **Attaching**
(``create=False``): open with ``O_NOFOLLOW``; the file must be a regular file of ours with one
link, not writable by others; ``flock(LOCK_SH)`` waits (up to :data:`ATTACH_WAIT_SECONDS`) for a
creation in progress; then the trailer is checked and compared with what the pool asks for.

**Lifetime.** The mapping (:class:`SharedMapping`) is unmapped and its descriptor closed when
nothing refers to it any more (the pool lets go after unpinning, and every tensor view is gone),
never at interpreter exit, like :class:`pinpool._memory.HostMapping`. The file is removed by its
*creator* (the process whose SharedMemory created it) unless ``keep`` is true: when the mapping is
released, or at interpreter exit, whichever comes first (removing a name unmaps nothing, so this
is safe while still pinned; the memory returns once the last process mapping it exits). A
process that attached never removes the file; nor does a forked child of the creator. A process
killed before it could remove the file leaves it behind: ``pinpool doctor`` lists regions, an
operator removes them with ``rm``. A memfd has no name: it lives while a descriptor or a mapping
refers to it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import socket
import stat
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _libc
from ._errors import ConfigError, PoolStateError
from ._node import _FILE_KINDS, _problem
from ._units import format_bytes, parse_size

if TYPE_CHECKING:
    import torch

    from .layouts import Layout

__all__ = [
    "ATTACH_WAIT_SECONDS",
    "FORMAT_VERSION",
    "MAGIC",
    "TRAILER_BYTES",
    "RegionInfo",
    "SharedMapping",
    "SharedMemory",
    "find_regions",
    "layout_record",
    "read_region",
]

MAGIC = b"pinpoolR"
FORMAT_VERSION = 1
TRAILER_BYTES = 4096
_FIXED = struct.Struct("<8sIIIIQQ")  # magic, version, body length, body CRC, flags, generation, reserved
_BODY_AT = _FIXED.size  # 40
_MAX_BODY = TRAILER_BYTES - _BODY_AT
_FLAGS_AT = 20
_GENERATION_AT = 24
FLAG_KEEP = 1
# How long attaching waits for a creation in progress (the creator holds LOCK_EX from the
# exclusive open until the trailer is written: microseconds, unless the creator stopped).
ATTACH_WAIT_SECONDS = 5.0
_POLL_SECONDS = 0.005
_UNINITIALISED_GRACE_SECONDS = 0.5  # an empty, unlocked file: the creator may not have taken its lock yet
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: a planted FIFO never blocks the open
_HUGE_PAGE_SIZES = {2 << 20: os.MFD_HUGE_2MB, 1 << 30: os.MFD_HUGE_1GB}
_FS_NAMES = {
    0xEF53: "ext2/3/4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x794C7630: "overlayfs", 0x6969: "nfs",
    0x858458F6: "ramfs", 0x65735546: "fuse", 0x01021997: "9p", 0xFF534D42: "cifs", 0x2FC12FC1: "zfs",
}  # fmt: skip
_SCAN_LIMIT = 10_000  # directory entries find_regions looks at, at most


def _align(n: int, page: int) -> int:
    return -(-n // page) * page


def _file_bytes(nbytes: int, page_size: int) -> int:
    """The size of a region file holding ``nbytes``: the data rounded to pages, plus the trailer's page."""
    return _align(nbytes, page_size) + page_size


def _fs_name(f_type: int) -> str:
    return _FS_NAMES.get(f_type, f"f_type {f_type:#x}")


def _page_size_of(f_type: int, f_bsize: int, where: str) -> int:
    """The page a region on this file system is made of, or :class:`ConfigError` for one it cannot live on."""
    if f_type == _libc.HUGETLBFS_MAGIC:
        return f_bsize
    if f_type == _libc.TMPFS_MAGIC:
        return _libc.PAGE_SIZE
    raise ConfigError(
        f"shared memory {where} is on a {_fs_name(f_type)} file system, not tmpfs or hugetlbfs: a pool's pages "
        "must be memory, not a disk file's page cache. Use a path on /dev/shm (tmpfs) or on a hugetlbfs mount, "
        "or path=None for a memfd"
    )


def _process_start(pid: int | str = "self") -> int | None:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 counts from 1 and starts 2 fields before the ")"
    except (IndexError, ValueError):
        return None


def layout_record(layout: Layout, num_pages: int) -> dict[str, object]:
    """What a region records about the pool it holds, to refuse a re-attach with another layout:
    the layout's name, page size, page count and each buffer's name, shape, dtype and granularity
    (JSON values, compared as JSON)."""
    return {
        "layout": layout.name,
        "page_bytes": int(layout.page_bytes),
        "num_pages": int(num_pages),
        "buffers": [
            {"name": b.name, "shape": [int(d) for d in b.shape], "dtype": str(b.dtype).removeprefix("torch."),
             "granularity": b.granularity}
            for b in layout.buffers(num_pages)
        ],
    }  # fmt: skip


# -- the trailer ------------------------------------------------------------------------------------


class _NotRegion(Exception):
    """The file holds no pinpool region; ``uninitialised``: its trailer is still all zeros."""

    def __init__(self, problem: str, *, uninitialised: bool = False) -> None:
        super().__init__(problem)
        self.problem = problem
        self.uninitialised = uninitialised


@dataclass(frozen=True)
class _Trailer:
    version: int
    flags: int
    generation: int
    body: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return int(self.body["nbytes"])

    @property
    def page_size(self) -> int:
        return int(self.body["page_size"])

    @property
    def record(self) -> dict[str, Any]:
        record = self.body.get("record")
        return record if isinstance(record, dict) else {}

    @property
    def created(self) -> dict[str, Any]:
        created = self.body.get("created")
        return created if isinstance(created, dict) else {}


def _encode_body(nbytes: int, page_size: int, record_json: str) -> bytes:
    created = {
        "uid": os.geteuid(), "pid": os.getpid(), "start": _process_start(), "unix": round(time.time(), 3),
        "host": socket.gethostname(),
    }  # fmt: skip
    body = json.dumps(
        {"nbytes": nbytes, "page_size": page_size, "record": json.loads(record_json), "created": created},
        sort_keys=True, separators=(",", ":"),
    ).encode()  # fmt: skip
    if len(body) > _MAX_BODY:
        raise ConfigError(
            f"the pool's description for its shared memory trailer is {len(body)} bytes, more than the "
            f"{_MAX_BODY} a trailer holds: a layout with fewer buffers (or shorter names) is needed"
        )
    return body


def _parse_trailer(raw: bytes) -> _Trailer:
    if len(raw) < TRAILER_BYTES:
        raise _NotRegion(f"is smaller than a pinpool trailer ({TRAILER_BYTES} bytes)")
    magic, version, length, crc, flags, generation, _reserved = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        if not any(raw):
            raise _NotRegion("holds no pinpool trailer yet (all zeros)", uninitialised=True)
        raise _NotRegion("is not a pinpool region, or a newer format (its last 4 KiB hold no pinpool trailer)")
    if version > FORMAT_VERSION or version == 0:
        raise _NotRegion(
            f"is a pinpool region of format version {version}; this pinpool reads version {FORMAT_VERSION}: "
            "not a pinpool region, or a newer format (use the pinpool that made it)"
        )
    body = raw[_BODY_AT : _BODY_AT + length]
    if length > _MAX_BODY or zlib.crc32(body) != crc:
        raise _NotRegion("has a corrupt pinpool trailer (its checksum does not match)")
    try:
        parsed = json.loads(body)
        trailer = _Trailer(version, flags, generation, parsed)
        if trailer.nbytes <= 0 or trailer.page_size <= 0:
            raise ValueError("sizes")
    except (ValueError, TypeError, KeyError, AttributeError):
        raise _NotRegion("has a corrupt pinpool trailer (its description cannot be read)") from None
    return trailer


def _read_trailer(fd: int, file_bytes: int) -> _Trailer:
    """The trailer of the open file (``pread``: hugetlbfs files can be read, and a hole reads as zeros)."""
    if file_bytes < 2 * TRAILER_BYTES:
        if file_bytes == 0:
            raise _NotRegion("is empty: not initialised yet", uninitialised=True)
        raise _NotRegion(f"is too small ({file_bytes} bytes) for a pinpool region")
    return _parse_trailer(os.pread(fd, TRAILER_BYTES, file_bytes - TRAILER_BYTES))


def _write_trailer(address: int, body: bytes, *, keep: bool) -> None:
    """Write a trailer at ``address`` (the mapped last 4 KiB of the file), the magic last."""
    ctypes.memmove(address + _BODY_AT, body, len(body))
    head = _FIXED.pack(b"\0" * 8, FORMAT_VERSION, len(body), zlib.crc32(body), FLAG_KEEP if keep else 0, 0, 0)
    ctypes.memmove(address + 8, head[8:], len(head) - 8)
    ctypes.memmove(address, MAGIC, len(MAGIC))


def _check_generation(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise ConfigError(f"generation={value!r} must be an integer in [0, 2**64)")
    return value


def _compact(value: object, limit: int = 200) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(nbytes: int, record: Mapping[str, Any]) -> str:
    parts = [format_bytes(nbytes)]
    if "layout" in record:
        pages = f", {record['num_pages']} pages" if "num_pages" in record else ""
        size = f" of {record['page_bytes']} bytes" if pages and "page_bytes" in record else ""
        parts.append(f"({record['layout']} layout{pages}{size})")
    return " ".join(parts)


def _differences(held_nbytes: int, held: Mapping[str, Any], nbytes: int, asked: Mapping[str, Any]) -> str:
    found: list[str] = []
    if held_nbytes != nbytes:
        found.append(f"size: {format_bytes(held_nbytes)} ({held_nbytes} bytes) in the file, "
                     f"{format_bytes(nbytes)} ({nbytes} bytes) asked")  # fmt: skip
    found.extend(
        f"{key}: {_compact(held.get(key))} in the file, {_compact(asked.get(key))} asked"
        for key in sorted({*held, *asked})
        if held.get(key) != asked.get(key)
    )
    return "; ".join(found)


# -- what doctor and region() report ------------------------------------------------------------------


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
        keep=bool(trailer.flags & FLAG_KEEP), record=trailer.record,
        created_uid=created.get("uid") if isinstance(created.get("uid"), int) else None,
        created_pid=pid if isinstance(pid, int) else None, created_unix=when,
        created_host=host if isinstance(host, str) else None, creator_alive=alive,
        age_seconds=None if when is None else max(0.0, time.time() - when),
    )  # fmt: skip


def read_region(path: str) -> RegionInfo | None:
    """What the file at ``path`` holds, or None when it is no pinpool region (or cannot be read).
    Never follows a symbolic link, never blocks on a FIFO, never raises for a bad file."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
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


def find_regions(directories: Iterable[str] | None = None) -> list[RegionInfo]:
    """Every pinpool region in ``directories`` (default :func:`region_directories`) and in their
    immediate subdirectories, by path; files that are not regions, or cannot be read, are skipped."""
    regions: list[RegionInfo] = []
    budget = _SCAN_LIMIT
    pending = [(d, 1) for d in (region_directories() if directories is None else directories)]
    while pending and budget > 0:
        directory, depth = pending.pop(0)
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries[:budget]:
            budget -= 1
            try:
                if entry.is_dir(follow_symlinks=False):
                    if depth > 0:
                        pending.append((entry.path, depth - 1))
                elif entry.is_file(follow_symlinks=False):
                    info = read_region(entry.path)
                    if info is not None:
                        regions.append(info)
            except OSError:
                continue
    return sorted(regions, key=lambda r: r.path)


# -- the mapping ------------------------------------------------------------------------------------


class _Unlinker:
    """Removes the creator's file once (unless ``keep``), only in the process that created it, and
    only if the name still refers to the file it created; closes the directory descriptor."""

    def __init__(self, dir_fd: int, name: str, identity: tuple[int, int], *, keep: bool) -> None:
        self.dir_fd = dir_fd
        self.name = name
        self.identity = identity
        self.keep = keep
        self.pid = os.getpid()
        self.done = False
        self.removed = False
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
                    st = os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
                    if (st.st_dev, st.st_ino) == self.identity:
                        os.unlink(self.name, dir_fd=self.dir_fd)
                        self.removed = True
            except OSError:
                pass  # already removed (by an operator), or the directory is gone: nothing to do
            finally:
                os.close(self.dir_fd)


# munmap frees every page of the range holding the process's mmap_lock for writing: in pieces,
# as pinpool._memory does for the pool's own mapping (not imported from there: it loads torch).
_UNMAP_PIECE_BYTES = 128 << 20


def _release(base: int, file_bytes: int, fd: int, unlink: _Unlinker | None) -> None:
    for offset in range(0, file_bytes, _UNMAP_PIECE_BYTES):
        _libc.munmap(base + offset, min(_UNMAP_PIECE_BYTES, file_bytes - offset))
    try:
        os.close(fd)
    except OSError:
        pass
    if unlink is not None:
        unlink()


# Mappings that must outlive everything because a chunk of them may still be registered.
_KEPT_FOREVER: list[SharedMapping] = []
_kept_lock = threading.Lock()


class SharedMapping:
    """A region mapped ``MAP_SHARED`` in this process: the same interface as the pool's own
    :class:`~pinpool._memory.HostMapping` (``address``, ``length``, ``nbytes``, ``huge_pages``,
    ``view()``, ``keep_forever()``, ``unmapped``), plus the region's ``fd``, ``path``,
    ``page_size``, ``file_bytes``, ``created`` and its ``generation``.

    ``address`` is the pool's data (file offset 0): page-aligned, huge-page-aligned on hugetlbfs.
    ``length`` is the data rounded up to ``page_size``; the trailer's page follows it in the same
    mapping and is never part of the pool. Unmapped (and ``fd`` closed, and the file removed by
    its creator unless kept) when nothing refers to this object any more, never at interpreter
    exit; the file's removal also runs at interpreter exit (see the module's docstring).
    """

    def __init__(
        self, *, base: int, file_bytes: int, nbytes: int, page_size: int, fd: int, path: str | None,
        created: bool, unlinker: _Unlinker | None,
    ) -> None:  # fmt: skip
        self.address = base
        self.length = _align(nbytes, page_size)
        self.nbytes = nbytes
        self.page_size = page_size
        self.huge_pages: bool | str = "hugetlb" if page_size > _libc.PAGE_SIZE else False
        # Pre-fault a shared mapping with MADV_POPULATE_READ: a read fault on a shared file maps up to
        # 16 pages the file holds already at once (fault-around), a write fault one page at a time.
        # Measured with 1 GiB on tmpfs: resident pages 0.40 s read against 0.86 s write; new pages are
        # allocated and zeroed either way (docs/shared-memory.md).
        self.populate_advice = _libc.MADV_POPULATE_READ
        self.fd = fd
        self.path = path
        self.created = created
        self.file_bytes = file_bytes
        self._trailer = base + file_bytes - TRAILER_BYTES
        self._unlinker = unlinker
        self._finalizer = weakref.finalize(self, _release, base, file_bytes, fd, unlinker)
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

    def keep_forever(self) -> None:
        """Never unmap: part of this memory may still be registered with the runtime. (A creator
        that does not keep the file still removes its name at exit.)"""
        with _kept_lock:
            _KEPT_FOREVER.append(self)

    @property
    def unmapped(self) -> bool:
        return not self._finalizer.alive

    def _check_mapped(self) -> None:
        if self.unmapped:
            raise PoolStateError("the shared memory region was unmapped: its generation cannot be read here")

    @property
    def generation(self) -> int:
        """The region's generation number, read from the mapped trailer (all processes see one value)."""
        self._check_mapped()
        return int(ctypes.c_uint64.from_address(self._trailer + _GENERATION_AT).value)

    def set_generation(self, value: int) -> None:
        """Store ``value`` as the region's generation (one aligned 8-byte store, seen by every process at once)."""
        value = _check_generation(value)
        self._check_mapped()
        ctypes.c_uint64.from_address(self._trailer + _GENERATION_AT).value = value

    def _set_keep_flag(self, keep: bool) -> None:
        if not self.unmapped:
            flags = ctypes.c_uint32.from_address(self._trailer + _FLAGS_AT)
            flags.value = (flags.value | FLAG_KEEP) if keep else (flags.value & ~FLAG_KEEP)

    def __repr__(self) -> str:
        where = self.path or f"fd {self.fd}"
        state = "unmapped" if self.unmapped else f"at {self.address:#x}"
        return f"<SharedMapping {where} {format_bytes(self.nbytes)} {state}>"


# -- SharedMemory ------------------------------------------------------------------------------------


def _dir_problem(st: os.stat_result) -> str | None:
    """What makes a region's directory untrustworthy, or None. Ours or root's, and not writable by
    others unless sticky (``/dev/shm``, ``/tmp``: others may add names there, but may not remove or
    replace ours; the file itself is checked when opened)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (pinpool never follows a link to a region's directory)"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return (
            f"is group- or world-writable without the sticky bit (mode {stat.S_IMODE(st.st_mode):#o}): another "
            "user could replace the region's file"
        )
    if st.st_uid not in (os.geteuid(), 0):
        return f"is owned by uid {st.st_uid}, neither this process's uid {os.geteuid()} nor root"
    return None


def _region_file_problem(st: os.stat_result) -> str | None:
    """What makes an existing region file unusable, or None: a regular file of ours with one link,
    not writable by others (like node pacing's lock files)."""
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return "is a symbolic link (pinpool never follows links to a region's file)"
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), f"file type {stat.S_IFMT(mode):#o}")
        return f"is not a regular file ({kind})"
    if st.st_nlink > 1:
        return f"has {st.st_nlink} hard links (another name refers to the same memory)"
    return _problem(st)


class SharedMemory:
    """Pool memory shared between processes: a ``MAP_SHARED`` mapping of a file on tmpfs
    (``/dev/shm``), on hugetlbfs (2 MiB or 1 GiB pages, found with ``statfs``), or of a memfd
    (``path=None``), that several processes map and pin, and that may outlive its creator.

    ``path``: the region's file (its directory must exist, be ours or root's, not a symbolic link
    and not writable by others unless sticky, like ``/dev/shm``); ``None`` with ``fd=None``: a
    new memfd (``memfd_create``), shared by descriptor (:attr:`fd`) with forked or exec'd children
    (``pass_fds=``) or over a Unix socket (``socket.send_fds``). ``fd``: a descriptor another
    process handed on (SGLang's shm allocator, ``SCM_RIGHTS``); it stays the caller's (pinpool maps
    a duplicate of it).

    ``create=True`` makes the region (exclusively: an existing file is a :class:`ConfigError`;
    with ``fd=`` the file must be empty), sized to the pool; ``create=False`` attaches to one
    that holds a pinpool region, and refuses one whose size or layout differs from what the pool
    asks for (:class:`ConfigError` naming both). ``keep``: the creator leaves the file in place
    when it lets go (for a warm restart); without it the creator removes the file when the pool
    releases the memory, or at interpreter exit. It can be changed later (``shared.keep = True``
    at a graceful shutdown). ``mode``: of a file this creates (0600; never group- or
    world-writable). ``huge_page_size``: with ``path=None``, a memfd of 2 MiB or 1 GiB hugetlb
    pages (``MFD_HUGETLB``); with a path or ``fd``, the page size the file system must have.

    Constructing checks the arguments and the directory only; the file is created or opened when
    a pool maps it (:meth:`open_mapping`). One pool at a time maps a SharedMemory.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        create: bool = True,
        keep: bool = False,
        mode: int = 0o600,
        fd: int | None = None,
        huge_page_size: int | str | None = None,
    ) -> None:
        for name, value in (("create", create), ("keep", keep)):
            if not isinstance(value, bool):
                raise ConfigError(f"SharedMemory({name}={value!r}): must be True or False")
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
            raise ConfigError(f"SharedMemory(mode={mode!r}): must be a permission mode such as 0o600")
        if mode & 0o600 != 0o600 or mode & 0o022:
            raise ConfigError(
                f"SharedMemory(mode={mode:#o}): the owner must be able to read and write the region and nobody "
                "else to write it (use 0o600, or 0o640 / 0o644 for readers of other users)"
            )
        huge = None if huge_page_size is None else parse_size(huge_page_size, what="huge_page_size")
        self._create = create
        self._keep = keep
        self._mode = mode
        self._lock = threading.Lock()
        self._live: weakref.ref[SharedMapping] | None = None
        self._made: tuple[int, int] | None = None  # (st_dev, st_ino) of the file this object created
        self._path: str | None = None
        self._directory = self._name = ""
        self._given_fd: int | None = None
        self._memfd_flags = 0
        if path is not None and fd is not None:
            raise ConfigError("SharedMemory(path=..., fd=...): give one: a path to open, or a descriptor handed on")
        if fd is not None:
            if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
                raise ConfigError(f"SharedMemory(fd={fd!r}): must be an open file descriptor (an int >= 0)")
            if keep:
                raise ConfigError(
                    "SharedMemory(fd=..., keep=True): a descriptor has no name to keep or remove; its file lives "
                    "as long as its owner keeps it (and any mapping of it)"
                )
            try:
                st = os.fstat(fd)
                f_type, f_bsize = _libc.fstatfs(fd)
            except OSError as exc:
                raise ConfigError(f"SharedMemory(fd={fd}): not an open descriptor ({exc.strerror or exc})") from None
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"SharedMemory(fd={fd}): the descriptor is not a regular file (mode {st.st_mode:#o})")
            self._given_fd = fd
            self._page_size = _page_size_of(f_type, f_bsize, f"fd {fd}")
        elif path is not None:
            if isinstance(path, bytes) or not isinstance(path, str | os.PathLike):
                raise ConfigError(f"SharedMemory(path={path!r}): must be a str or os.PathLike path, or None")
            text = os.fspath(path)
            if not isinstance(text, str) or not text:
                raise ConfigError(f"SharedMemory(path={path!r}): must be a non-empty str path")
            self._path = os.path.abspath(text)
            self._directory, self._name = os.path.split(self._path)
            if not self._name or text.endswith("/"):
                raise ConfigError(f"SharedMemory(path={text!r}): name a file, not a directory")
            self._check_directory_path()
            f_type, f_bsize = _libc.statfs(self._directory)
            self._page_size = _page_size_of(f_type, f_bsize, f"path {self._path!r}")
        else:
            if not create:
                raise ConfigError(
                    "SharedMemory(create=False) needs something to attach to: a path= of an existing region, or "
                    "the fd= another process handed on"
                )
            if keep:
                raise ConfigError(
                    "SharedMemory(path=None, keep=True): a memfd has no name to keep; it lives while a descriptor "
                    "or a mapping refers to it. Give a path on /dev/shm or a hugetlbfs mount to keep a region"
                )
            self._memfd_flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
            self._page_size = _libc.PAGE_SIZE
            if huge is not None:
                size_flag = _HUGE_PAGE_SIZES.get(huge)
                if size_flag is None:
                    raise ConfigError(
                        f"SharedMemory(huge_page_size={huge_page_size!r}): a memfd's huge pages are 2 MiB or 1 GiB"
                    )
                self._memfd_flags |= os.MFD_HUGETLB | size_flag
                self._page_size = huge
        if huge is not None and huge != self._page_size:
            raise ConfigError(
                f"SharedMemory(huge_page_size={huge_page_size!r}): {self._where()} has "
                f"{format_bytes(self._page_size)} pages, not {format_bytes(huge)}"
                + (" (it is not on hugetlbfs)" if self._page_size == _libc.PAGE_SIZE else "")
            )

    # -- properties --------------------------------------------------------------------------------

    @property
    def path(self) -> str | None:
        """The region's file, absolute; None for a memfd or a descriptor handed on."""
        return self._path

    @property
    def fd(self) -> int | None:
        """The descriptor to hand on: the ``fd=`` given; else the open region's own (``O_CLOEXEC``)
        while a pool maps it; else None."""
        if self._given_fd is not None:
            return self._given_fd
        mapping = self.mapping
        return None if mapping is None else mapping.fd

    @property
    def create(self) -> bool:
        return self._create

    @property
    def keep(self) -> bool:
        """Whether the creator leaves the file in place when it lets go (settable, e.g. at shutdown)."""
        return self._keep

    @keep.setter
    def keep(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"SharedMemory.keep = {value!r}: must be True or False")
        if value and self._path is None:
            raise ConfigError("SharedMemory.keep = True: only a region with a path can be kept")
        self._keep = value
        mapping = self.mapping
        if mapping is not None and mapping._unlinker is not None:
            mapping._unlinker.keep = value
            mapping._set_keep_flag(value)

    @property
    def mode(self) -> int:
        return self._mode

    @property
    def page_size(self) -> int:
        """The page the region is made of: 4096 on tmpfs and memfds, the huge page size on hugetlbfs
        (2 MiB or 1 GiB). Chunk boundaries and buffer placement align to it."""
        return self._page_size

    @property
    def huge_pages(self) -> bool | str:
        """``"hugetlb"`` on hugetlbfs or a hugetlb memfd, else False (as PinnedPool.huge_pages)."""
        return "hugetlb" if self._page_size > _libc.PAGE_SIZE else False

    @property
    def mapping(self) -> SharedMapping | None:
        """The mapping a pool holds now, or None."""
        mapping = None if self._live is None else self._live()
        return None if mapping is None or mapping.unmapped else mapping

    def file_bytes(self, nbytes: int) -> int:
        """The region file's size for a pool of ``nbytes``: the data rounded up to pages, plus the trailer's page."""
        return _file_bytes(self._check_nbytes(nbytes), self._page_size)

    def __repr__(self) -> str:
        return f"SharedMemory({self._where()}, create={self._create}, keep={self._keep})"

    def _where(self) -> str:
        if self._path is not None:
            return repr(self._path)
        if self._given_fd is not None:
            return f"fd={self._given_fd}"
        return "memfd"

    # -- the region as it is now ----------------------------------------------------------------------

    def _open_region_file(self, *, write: bool = False) -> tuple[int, bool] | None:
        """A descriptor of the region's file as it is now, and whether the caller must close it;
        None when there is none yet (or the name is no file pinpool would use)."""
        mapping = self.mapping
        if mapping is not None:
            return mapping.fd, False
        if self._given_fd is not None:
            return self._given_fd, False
        if self._path is None:
            return None
        try:
            if _region_file_problem(os.lstat(self._path)) is not None:
                return None
            fd = os.open(self._path, (os.O_RDWR if write else os.O_RDONLY) | _OPEN_FLAGS)
        except OSError:
            return None
        if _region_file_problem(os.fstat(fd)) is not None:
            os.close(fd)
            return None
        return fd, True

    def _held(self) -> os.stat_result | None:
        opened = self._open_region_file()
        if opened is None:
            return None
        fd, close = opened
        try:
            return os.fstat(fd)
        finally:
            if close:
                os.close(fd)

    def resident_bytes(self, nbytes: int) -> int:
        """Bytes of a pool of ``nbytes`` that the region's file already holds in memory (resident,
        or swapped out on tmpfs): pages that mapping it will not newly take. 0 when there is no
        file yet (``create=True`` before the pool maps it; a memfd). Read from ``st_blocks``, the
        trailer's page not counted; for a region of this size it is exact, for another file an
        estimate (attaching to one is refused anyway)."""
        data = _align(self._check_nbytes(nbytes), self._page_size)
        st = self._held()
        if st is None:
            return 0
        beyond = max(0, st.st_size - data) // self._page_size * self._page_size
        return min(data, max(0, st.st_blocks * 512 - beyond))

    def new_bytes(self, nbytes: int) -> int:
        """Memory that mapping and faulting the region for a pool of ``nbytes`` takes that is not
        taken yet: :meth:`file_bytes` less what the file already holds (the trailer's page included)."""
        total = self.file_bytes(nbytes)
        st = self._held()
        return total if st is None else max(0, total - st.st_blocks * 512)

    def region(self) -> RegionInfo | None:
        """What the region's file holds now (from its trailer), or None when there is no region yet."""
        opened = self._open_region_file()
        if opened is None:
            return None
        fd, close = opened
        try:
            st = os.fstat(fd)
            return _region_info(self._path or self._where(), st, _read_trailer(fd, st.st_size))
        except (OSError, _NotRegion):
            return None
        finally:
            if close:
                os.close(fd)

    @property
    def generation(self) -> int:
        """The region's generation number: 0 when created, then whatever the server stores with
        :meth:`set_generation`. Read from the live mapping, else from the file.
        :class:`ConfigError` when there is no region to read."""
        mapping = self.mapping
        if mapping is not None:
            return mapping.generation
        info = self.region()
        if info is None:
            raise ConfigError(f"shared memory {self._where()} holds no pinpool region yet: it has no generation")
        return info.generation

    def set_generation(self, value: int) -> None:
        """Store ``value`` as the region's generation, in the live mapping, else in the file (its
        trailer's page mapped for the moment). Every process attached sees it at once."""
        value = _check_generation(value)
        mapping = self.mapping
        if mapping is not None:
            mapping.set_generation(value)
            return
        opened = self._open_region_file(write=True)
        if opened is None:
            raise ConfigError(f"shared memory {self._where()} holds no pinpool region yet: nothing to set")
        fd, close = opened
        try:
            size = os.fstat(fd).st_size
            _read_trailer(fd, size)  # refuse a file that holds no region
            page = self._page_size
            address, err = _libc.mmap_shared(page, fd, size - page)
            if err:
                raise ConfigError(f"shared memory {self._where()}: mapping its trailer failed: {_libc.errno_name(err)}")
            try:
                ctypes.c_uint64.from_address(address + page - TRAILER_BYTES + _GENERATION_AT).value = value
            finally:
                _libc.munmap(address, page)
        except _NotRegion as exc:
            raise ConfigError(f"shared memory {self._where()} {exc.problem}") from None
        finally:
            if close:
                os.close(fd)

    # -- mapping it -------------------------------------------------------------------------------------

    def _check_nbytes(self, nbytes: int) -> int:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ConfigError(f"a shared memory region of nbytes={nbytes!r}: must be a positive int")
        return nbytes

    def open_mapping(self, nbytes: int, record: Mapping[str, object]) -> SharedMapping:
        """Create or attach to the region for a pool of ``nbytes`` described by ``record`` (see
        :func:`layout_record`), map all of it ``MAP_SHARED`` in this process, and return the mapping.

        Creating writes ``nbytes`` and ``record`` into the trailer; attaching refuses a region
        whose ``nbytes`` or ``record`` differ (:class:`ConfigError` naming both). The pages are
        not faulted: the pool pre-faults and pins them. :class:`PoolStateError` while another
        pool maps this SharedMemory; :class:`~pinpool.AllocationError` when the kernel refuses the
        mapping (hugetlb pages short).
        """
        self._check_nbytes(nbytes)
        if not isinstance(record, Mapping):
            raise ConfigError(f"record={record!r} must be a mapping of JSON values (see layout_record)")
        try:
            record_json = json.dumps(record, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"record must hold JSON values only: {exc}") from None
        with self._lock:
            if self.mapping is not None:
                raise PoolStateError(
                    f"{self!r} is mapped by another pool in this process already; a SharedMemory is mapped by one "
                    "pool at a time (make another SharedMemory(path, create=False) to map the region twice)"
                )
            if self._path is None:
                fd = os.dup(self._given_fd) if self._given_fd is not None else self._new_memfd()
                where = f"fd {self._given_fd}" if self._given_fd is not None else "memfd"
                try:
                    if self._create:
                        mapping = self._initialise(fd, nbytes, record_json, where, None)
                    else:
                        mapping = self._attach(fd, nbytes, record_json, where, None)
                except BaseException:
                    os.close(fd)
                    raise
            else:
                mapping = self._open_path(nbytes, record_json)
            self._live = weakref.ref(mapping)
            return mapping

    def _new_memfd(self) -> int:
        try:
            return os.memfd_create("pinpool-region", self._memfd_flags)
        except OSError as exc:
            huge = " with hugetlb pages (MFD_HUGETLB)" if self._memfd_flags & os.MFD_HUGETLB else ""
            raise ConfigError(f"memfd_create{huge} failed: {exc.strerror or exc}") from None

    def _check_directory_path(self) -> None:
        try:
            st = os.lstat(self._directory)
        except OSError as exc:
            raise ConfigError(
                f"shared memory directory {self._directory!r} of {self._path!r} cannot be used: "
                f"{exc.strerror or exc}; create it (mode 0700) or choose a path on /dev/shm"
            ) from None
        self._refuse_directory(st)

    def _refuse_directory(self, st: os.stat_result) -> None:
        problem = _dir_problem(st)
        if problem is not None:
            raise ConfigError(
                f"shared memory directory {self._directory!r} {problem}; use a directory this user owns that only "
                f"it can write (`chmod go-w`), or /dev/shm, for {self._path!r}"
            )

    def _open_directory(self) -> int:
        """The directory, opened ``O_DIRECTORY | O_NOFOLLOW`` and checked again (it may have changed)."""
        self._check_directory_path()
        try:
            dir_fd = os.open(self._directory, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
        except OSError as exc:
            raise ConfigError(
                f"shared memory directory {self._directory!r} cannot be opened: {exc.strerror or exc}"
            ) from None
        try:
            self._refuse_directory(os.fstat(dir_fd))
        except BaseException:
            os.close(dir_fd)
            raise
        return dir_fd

    def _file_error(self, problem: str, fix: str = "") -> ConfigError:
        fix = fix or "remove it if no process uses it (`rm` it; `pinpool doctor` lists regions), or choose another path"
        return ConfigError(f"shared memory file {self._path!r} {problem}; {fix}")

    def _open_existing_path(self, path: str, dir_fd: int | None = None) -> int:
        """Open the region's file to attach (``O_RDWR``), checked before and after the open."""
        name = self._name if dir_fd is not None else path
        try:
            problem = _region_file_problem(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
        except FileNotFoundError:
            raise self._file_error(
                "does not exist", "create it with create=True, or wait until its creator has (the path must exist)"
            ) from None
        if problem is not None:
            raise self._file_error(problem)
        try:
            fd = os.open(name, os.O_RDWR | _OPEN_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._file_error("is a symbolic link (pinpool never follows links to a region's file)") from None
            if exc.errno == errno.ENOENT:
                raise self._file_error("was removed while being opened", "create it again, or retry") from None
            raise self._file_error(f"cannot be opened for reading and writing ({exc.strerror or exc})") from None
        try:
            st = os.fstat(fd)
            problem = "was removed while being opened" if st.st_nlink == 0 else _region_file_problem(st)
            if problem is not None:
                raise self._file_error(problem)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_path(self, nbytes: int, record_json: str) -> SharedMapping:
        assert self._path is not None
        where = repr(self._path)
        dir_fd = self._open_directory()  # closed below; an unlinker keeps a duplicate of its own
        try:
            if self._create and not self._made_here(dir_fd):
                fd = self._create_file(dir_fd)
                st = os.fstat(fd)
                identity = (st.st_dev, st.st_ino)
                try:
                    mapping = self._initialise(fd, nbytes, record_json, where, self._unlinker_for(dir_fd, identity))
                except BaseException:
                    os.close(fd)
                    _remove(dir_fd, self._name, identity)
                    raise
                self._made = identity
                return mapping
            fd = self._open_existing_path(self._path, dir_fd)
            try:
                st = os.fstat(fd)
                # This object made it and kept it (a pool opened again): it is still the creator.
                made = self._made == (st.st_dev, st.st_ino)
                unlinker = self._unlinker_for(dir_fd, (st.st_dev, st.st_ino)) if made else None
                return self._attach(fd, nbytes, record_json, where, unlinker)
            except BaseException:
                os.close(fd)
                raise
        finally:
            os.close(dir_fd)

    def _unlinker_for(self, dir_fd: int, identity: tuple[int, int]) -> Callable[[], _Unlinker]:
        return lambda: _Unlinker(os.dup(dir_fd), self._name, identity, keep=self._keep)

    def _create_file(self, dir_fd: int) -> int:
        """Create the region's file exclusively (never following a link), mode ``self.mode``."""
        try:
            fd = os.open(self._name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, self._mode, dir_fd=dir_fd)
        except FileExistsError:
            try:
                link = stat.S_ISLNK(os.stat(self._name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
            except OSError:
                link = False
            if link:
                raise self._file_error("exists already as a symbolic link (pinpool never follows one)") from None
            held = read_region(self._path or "")
            what = (
                f"holds a pinpool region already ({_describe(held.nbytes, held.record)}, generation {held.generation})"
                if held is not None
                else "exists already"
            )
            raise self._file_error(
                what, "attach to it with create=False, or remove it (`rm` it) if no process uses it"
            ) from None
        except OSError as exc:
            raise self._file_error(f"cannot be created ({exc.strerror or exc})", "check the directory") from None
        try:
            if os.fstat(fd).st_mode & 0o022:  # a umask never adds bits, but a default ACL may
                os.fchmod(fd, self._mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _made_here(self, dir_fd: int) -> bool:
        """Whether the name is the file this object created earlier and kept (a pool opened again)."""
        if self._made is None:
            return False
        try:
            st = os.stat(self._name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._made

    def _check_room(self, fd: int, needed: int, where: str) -> None:
        """On tmpfs, a fault past the file system's size kills the process (SIGBUS): refuse first."""
        if self.huge_pages or needed <= 0:
            return  # hugetlbfs reserves the pages when mapping, and says ENOMEM then
        try:
            vfs = os.fstatvfs(fd)
        except OSError:
            return
        if vfs.f_blocks == 0:
            return  # no size limit (the memfd mount)
        free = vfs.f_bavail * vfs.f_frsize
        if needed > free:
            place = self._directory or where
            raise ConfigError(
                f"shared memory {where}: the file system ({place}) has {format_bytes(free)} free of "
                f"{format_bytes(vfs.f_blocks * vfs.f_frsize)}, the region needs {format_bytes(needed)} more; a page "
                "fault past its size would kill the process (SIGBUS). Remove regions no longer used (`pinpool "
                "doctor` lists them), make the pool smaller, or enlarge the mount (`mount -o remount,size=...`)"
            )

    def _map(self, fd: int, file_bytes: int, where: str) -> int:
        address, err = _libc.mmap_shared(file_bytes, fd)
        if err:
            from ._memory import AllocationError

            if err == errno.EACCES:
                raise ConfigError(
                    f"shared memory {where} cannot be mapped for writing (EACCES): the descriptor must be open for "
                    "reading and writing"
                )
            hint = (
                f"; reserve more {format_bytes(self._page_size)} hugetlb pages (HugePages_Free in /proc/meminfo)"
                if self.huge_pages and err == errno.ENOMEM
                else ""
            )
            raise AllocationError(
                f"mmap of shared memory {where} ({format_bytes(file_bytes)}) failed: {_libc.errno_name(err)} "
                f"({os.strerror(err)}){hint}"
            )
        return address

    def _initialise(
        self, fd: int, nbytes: int, record_json: str, where: str, unlinker: Callable[[], _Unlinker] | None
    ) -> SharedMapping:
        """Size a new (empty) file, map it and write its trailer, under LOCK_EX."""
        body = _encode_body(nbytes, self._page_size, record_json)
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
        file_bytes = _file_bytes(nbytes, self._page_size)
        self._check_room(fd, file_bytes, where)
        try:
            os.ftruncate(fd, file_bytes)
        except OSError as exc:
            hint = " (check the hugetlbfs mount's size= limit)" if self.huge_pages else ""
            raise ConfigError(
                f"shared memory {where} cannot be sized to {format_bytes(file_bytes)}: {exc.strerror or exc}{hint}"
            ) from None
        address = self._map(fd, file_bytes, where)
        try:
            _write_trailer(address + file_bytes - TRAILER_BYTES, body, keep=self._keep)
            if self._memfd_flags:
                try:  # nobody shrinks or grows a memfd under the mappings (a shrink would SIGBUS them)
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
                except OSError:
                    pass
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            _libc.munmap(address, file_bytes)
            raise
        return SharedMapping(
            base=address, file_bytes=file_bytes, nbytes=nbytes, page_size=self._page_size, fd=fd,
            path=self._path, created=True, unlinker=None if unlinker is None else unlinker(),
        )  # fmt: skip

    def _locked_trailer(self, fd: int, where: str) -> tuple[os.stat_result, _Trailer]:
        """The trailer, read under LOCK_SH once no creation is in progress (waits up to
        :data:`ATTACH_WAIT_SECONDS`); :class:`ConfigError` for a file that holds no region."""
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
            try:
                st = os.fstat(fd)
                return st, _read_trailer(fd, st.st_size)
            except _NotRegion as exc:
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
                fcntl.flock(fd, fcntl.LOCK_UN)
            time.sleep(_POLL_SECONDS)

    def _attach(
        self, fd: int, nbytes: int, record_json: str, where: str, unlinker: Callable[[], _Unlinker] | None
    ) -> SharedMapping:
        st, trailer = self._locked_trailer(fd, where)
        if trailer.page_size != self._page_size:
            raise ConfigError(
                f"shared memory {where} was made of {format_bytes(trailer.page_size)} pages, but its file system has "
                f"{format_bytes(self._page_size)} pages: it was copied or moved; remove it and create it again"
            )
        expected = _file_bytes(trailer.nbytes, trailer.page_size)
        if st.st_size != expected:
            raise ConfigError(
                f"shared memory {where} is {st.st_size} bytes, but its trailer says it holds "
                f"{format_bytes(trailer.nbytes)} ({expected} bytes of file): it was truncated or grown by something "
                "else than pinpool; remove it and create it again"
            )
        asked = json.loads(record_json)
        if trailer.nbytes != nbytes or trailer.record != asked:
            raise ConfigError(
                f"shared memory {where} holds {_describe(trailer.nbytes, trailer.record)}, but the pool asks for "
                f"{_describe(nbytes, asked)}: {_differences(trailer.nbytes, trailer.record, nbytes, asked)}. A "
                "region is attached only with the layout and size it was made with: give the pool those, or "
                "remove the region (`rm` it) and create it again"
            )
        file_bytes = st.st_size
        self._check_room(fd, file_bytes - st.st_blocks * 512, where)
        address = self._map(fd, file_bytes, where)
        return SharedMapping(
            base=address, file_bytes=file_bytes, nbytes=nbytes, page_size=self._page_size, fd=fd, path=self._path,
            created=unlinker is not None, unlinker=None if unlinker is None else unlinker(),
        )  # fmt: skip


def _remove(dir_fd: int, name: str, identity: tuple[int, int]) -> None:
    """Remove a file this process just created and could not make a region of (if the name still refers to it)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == identity:
            os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
