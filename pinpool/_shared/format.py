"""A shared memory region's on-disk format (data from offset 0, a 4 KiB trailer in the file's last
page: docs/shared-memory.md), and reading regions without mapping them. The trailer is *untrusted
input*: a bad one is :class:`NotRegion`, never a crash or an escape sequence on a terminal, and
reading regions (``pinpool doctor``) never raises, follows a symbolic link or blocks on a FIFO."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import re
import secrets
import socket
import stat
import struct
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError
from .._host import libc as _libc
from .._host.files import FILE_FLAGS
from .._units import format_bytes

if TYPE_CHECKING:
    from ..layouts import Layout

MAGIC = b"pinpoolR"
FORMAT_VERSION = 1
TRAILER_BYTES = 4096
_FIXED = struct.Struct("<8sIIIIQQ")  # magic, version, body length, body CRC, flags, generation, reserved
_BODY_AT = _FIXED.size  # 40
_MAX_BODY = TRAILER_BYTES - _BODY_AT
FLAGS_AT = 20
GENERATION_AT = 24
FLAG_KEEP = 1
FLAG_INTENTS = 2  # the trailer's last INTENT_SLOTS * INTENT_SLOT_BYTES hold write intents (see intents.py)
INTENTS_AT = 3072  # in the trailer: a body up to here leaves the rest for write intents
INTENT_SLOT_BYTES = 16
INTENT_SLOTS = (TRAILER_BYTES - INTENTS_AT) // INTENT_SLOT_BYTES  # 64 writers at once
_PAGE = _libc.PAGE_SIZE
_MAX_DEPTH = 8  # the body nests 5 deep (body, record, buffers, a buffer, its shape)
_MAX_SIZE = 1 << 62  # larger than any host's memory, small enough for every later sum


def align(n: int, page: int) -> int:
    return -(-n // page) * page


def region_file_bytes(nbytes: int, page_size: int) -> int:
    """The size of a region file holding ``nbytes``: the data rounded to pages, plus the trailer's page."""
    return align(nbytes, page_size) + page_size


def _process_start(pid: int | str = "self") -> int | None:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
        return int(text[text.rfind(b")") + 2 :].split()[19])  # field 22 counts from 1, 2 before the ")"
    except (OSError, IndexError, ValueError):
        return None


def layout_record(layout: Layout, num_pages: int) -> dict[str, object]:
    """What a region records about its pool (JSON values), to refuse a re-attach with another layout."""
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


class NotRegion(Exception):
    """The file holds no pinpool region; ``uninitialised``: its trailer is still all zeros."""

    def __init__(self, problem: str, *, uninitialised: bool = False) -> None:
        super().__init__(problem)
        self.problem = problem
        self.uninitialised = uninitialised


@dataclass(frozen=True)
class Trailer:
    version: int
    flags: int
    generation: int
    nbytes: int
    page_size: int
    region_id: str
    record: dict[str, Any]
    created: dict[str, Any]


def encode_body(nbytes: int, page_size: int, record_json: str) -> bytes:
    created = {
        "uid": os.geteuid(), "pid": os.getpid(), "start": _process_start(), "unix": round(time.time(), 3),
        "host": socket.gethostname(),
    }  # fmt: skip
    fields = {"nbytes": nbytes, "page_size": page_size, "region_id": secrets.token_hex(16),  # 128 random bits
              "record": json.loads(record_json), "created": created}  # fmt: skip
    if (problem := _untrusted_problem(fields, 1)) is not None:
        raise ConfigError(f"the pool's description cannot be kept in a shared memory trailer: {problem}")
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    if len(body) > _MAX_BODY:
        raise ConfigError(
            f"the pool's description for its shared memory trailer is {len(body)} bytes, more than the "
            f"{_MAX_BODY} a trailer holds: a layout with fewer buffers (or shorter names) is needed"
        )
    return body


def _untrusted_problem(value: object, depth: int) -> str | None:
    """Why a parsed (or to be written) body is not one pinpool reads (its text reaches terminals), or None."""
    if depth > _MAX_DEPTH:
        return f"it nests more than {_MAX_DEPTH} deep"
    if isinstance(value, str):
        return (
            None if value.isprintable() and value.isascii() else f"the text {ascii(value)[:60]} is not printable ASCII"
        )
    if isinstance(value, float):
        return None if math.isfinite(value) else "a number is not finite"
    if isinstance(value, dict):
        items: list[object] = [*value.keys(), *value.values()]
    elif isinstance(value, list):
        items = value
    else:
        return None
    return next((p for p in (_untrusted_problem(v, depth + 1) for v in items) if p is not None), None)


_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"?|[][{}]', re.DOTALL)  # a string (to its end), or a bracket
_DEPTH = {b"[": 1, b"{": 1, b"]": -1, b"}": -1}


def _nesting(body: bytes) -> int:
    """The deepest ``[``/``{`` nesting outside strings, checked before ``json.loads`` (whose recursion it bounds)."""
    depth = deepest = 0
    for token in _JSON_TOKENS.findall(body):
        depth += _DEPTH.get(token, 0)
        deepest = max(deepest, depth)
    return deepest


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number pinpool writes")


def _size_field(body: dict[str, Any], key: str) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX_SIZE:
        raise ValueError(f"{key} is not a size")
    return value


def _parse_body(body: bytes) -> dict[str, Any]:
    """The trailer's JSON body, parsed as untrusted input; ValueError says what is wrong."""
    if _nesting(body) > _MAX_DEPTH:
        raise ValueError(f"it nests more than {_MAX_DEPTH} deep")
    parsed = json.loads(body, parse_constant=_no_constant)
    if not isinstance(parsed, dict):
        raise ValueError("it is not a JSON object")
    if (problem := _untrusted_problem(parsed, 1)) is not None:
        raise ValueError(problem)
    _size_field(parsed, "nbytes")
    page_size = _size_field(parsed, "page_size")
    if page_size & (page_size - 1) or page_size < 4096:
        raise ValueError("page_size is not a page size")
    region_id = parsed.get("region_id")
    if region_id is None:  # made before regions had an identity: the body names its creation
        parsed["region_id"] = hashlib.blake2b(body, digest_size=16).hexdigest()
    elif not isinstance(region_id, str) or not 0 < len(region_id) <= 64:
        raise ValueError("region_id is not an identity")
    return parsed


def _parse_trailer(raw: bytes) -> Trailer:
    if len(raw) < TRAILER_BYTES:
        raise NotRegion(f"is smaller than a pinpool trailer ({TRAILER_BYTES} bytes)")
    magic, version, length, crc, flags, generation, _reserved = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        if not any(raw):
            raise NotRegion("holds no pinpool trailer yet (all zeros)", uninitialised=True)
        raise NotRegion("is not a pinpool region, or a newer format (its last 4 KiB hold no pinpool trailer)")
    if version > FORMAT_VERSION or version == 0:
        raise NotRegion(
            f"is a pinpool region of format version {version}; this pinpool reads version {FORMAT_VERSION}: "
            "not a pinpool region, or a newer format (use the pinpool that made it)"
        )
    body = raw[_BODY_AT : _BODY_AT + length]
    if length > _MAX_BODY or zlib.crc32(body) != crc:
        raise NotRegion("has a corrupt pinpool trailer (its checksum does not match)")
    try:
        parsed = _parse_body(body)
    except (ValueError, UnicodeDecodeError) as exc:  # json.JSONDecodeError and int-digit limits are ValueErrors
        raise NotRegion(f"has a corrupt pinpool trailer (its description cannot be read: {exc})") from None
    record, created = (parsed.get(key) for key in ("record", "created"))
    return Trailer(
        version, flags, generation, parsed["nbytes"], parsed["page_size"], parsed["region_id"],
        record if isinstance(record, dict) else {}, created if isinstance(created, dict) else {},
    )  # fmt: skip


def read_trailer(fd: int, file_bytes: int) -> Trailer:
    """The trailer of the open file (``pread``: hugetlbfs files can be read, and a hole reads as zeros)."""
    if file_bytes < 2 * TRAILER_BYTES:
        if file_bytes == 0:
            raise NotRegion("is empty: not initialised yet", uninitialised=True)
        raise NotRegion(f"is too small ({file_bytes} bytes) for a pinpool region")
    return _parse_trailer(os.pread(fd, TRAILER_BYTES, file_bytes - TRAILER_BYTES))


def write_new_trailer(fd: int, file_bytes: int, body: bytes, where: str, *, keep: bool, page_size: int) -> None:
    """Write a new file's whole trailer holding ``body``, the magic last (a file without it is no region)."""
    # A body short enough leaves room for write intents: the flag says so (a pinpool before them ignores both).
    flags = (FLAG_KEEP if keep else 0) | (FLAG_INTENTS if _BODY_AT + len(body) <= INTENTS_AT else 0)
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, len(body), zlib.crc32(body), flags, 0, 0)
    trailer = (head + body).ljust(TRAILER_BYTES, b"\0")
    store(fd, file_bytes, len(MAGIC), trailer[len(MAGIC) :], where, page_size=page_size)
    store(fd, file_bytes, 0, trailer[: len(MAGIC)], where, page_size=page_size)


def _checked_size(fd: int, file_bytes: int, where: str) -> None:
    """:class:`ConfigError` unless the file is still ``file_bytes`` long (a page past its end is SIGBUS)."""
    size = os.fstat(fd).st_size
    if size != file_bytes:
        raise ConfigError(
            f"shared memory {where} is {size} bytes now, not the {file_bytes} its region was made with: another "
            "process truncated or resized it, so its pages past the end are gone and the region cannot be used; "
            "stop the pool, remove the file (`rm` it) and create the region again"
        )


def read_field(fd: int, file_bytes: int, at: int, size: int, where: str) -> bytes:
    """``size`` bytes at ``at`` of the trailer, by ``pread`` after a size check: never SIGBUS."""
    _checked_size(fd, file_bytes, where)
    raw = os.pread(fd, size, file_bytes - TRAILER_BYTES + at)
    if len(raw) != size:  # truncated between the check and the read
        _checked_size(fd, file_bytes, where)
        raise ConfigError(f"shared memory {where}: its trailer could not be read ({len(raw)} of {size} bytes)")
    return raw


def write_field(fd: int, file_bytes: int, at: int, data: bytes, where: str, *, page_size: int) -> None:
    _checked_size(fd, file_bytes, where)
    store(fd, file_bytes, at, data, where, page_size=page_size)


def store(fd: int, file_bytes: int, at: int, data: bytes, where: str, *, page_size: int) -> None:
    """Write ``data`` at ``at`` of the trailer: ``pwrite``, or on hugetlbfs (no writes) through a mapping."""
    offset = file_bytes - TRAILER_BYTES + at
    if page_size == _PAGE:
        os.pwrite(fd, data, offset)
        return
    address, err = _libc.mmap_shared(page_size, fd, file_bytes - page_size)
    if err:
        raise ConfigError(f"shared memory {where}: mapping its trailer failed: {_libc.errno_name(err)}")
    try:
        _write_mapped(address + page_size - TRAILER_BYTES + at, data, where)
    finally:
        _libc.munmap(address, page_size)


def _write_mapped(address: int, data: bytes, where: str) -> None:
    """Store via ``/proc/self/mem`` (a page truncated since the size check: EIO, not SIGBUS), else plainly."""
    try:
        mem = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        ctypes.memmove(address, data, len(data))
        return
    try:
        os.pwrite(mem, data, address)
    except OSError as exc:
        raise ConfigError(
            f"shared memory {where}: its trailer's page is gone ({_libc.errno_name(exc.errno or 0)}): another "
            "process truncated or resized the file; remove it and create the region again"
        ) from None
    finally:
        os.close(mem)


def _compact(value: object, limit: int = 200) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(nbytes: int, record: Mapping[str, Any]) -> str:
    if "layout" not in record:
        return format_bytes(nbytes)
    pages = f", {record['num_pages']} pages" if "num_pages" in record else ""
    size = f" of {record['page_bytes']} bytes" if pages and "page_bytes" in record else ""
    return f"{format_bytes(nbytes)} ({record['layout']} layout{pages}{size})"


def differences(held_nbytes: int, held: Mapping[str, Any], nbytes: int, asked: Mapping[str, Any]) -> str:
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


# -- finding and reading regions -------------------------------------------------------------------

_SCAN_LIMIT = 1_000_000  # directory entries find_regions looks at, at most (an lstat each, at worst)
TEMP_MARK = ".pinpool-new-"  # in the temporary name a region is made under (see files.create_temp_file)


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a region's temporary file, as files.create_temp_file names one."""
    head, _mark, tail = name.rpartition(TEMP_MARK)
    return len(head) > 1 and head[0] == "." and len(tail) == 16 and all(c in "0123456789abcdef" for c in tail)


@dataclass(frozen=True)
class RegionInfo:
    """What a region file holds, from its trailer and its ``stat``. ``held_bytes``: memory it holds
    now, trailer included. ``creator_alive``: None when made on another host (its own hostname).
    ``in_use``: whether a process maps it through pinpool now (its mapping holds ``LOCK_SH`` on the
    file while mapped, and a dead process's lock is gone with it); None when not looked at."""

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
    created_pid: int | None
    created_host: str | None
    creator_alive: bool | None
    age_seconds: float | None
    in_use: bool | None = None
    suspect_pages: tuple[range, ...] | None = None  # runs dead writers left marked (None: no intents, or unread)

    @property
    def orphaned(self) -> bool:
        """Its creator is gone (pid dead, or reused by another process) and no process maps it: a
        whole region (its trailer read back complete) that the next process may re-attach, bytes intact."""
        return self.creator_alive is False and self.in_use is False


def _in_use(fd: int) -> bool | None:
    """Whether another open file holds a lock on the region: a pinpool mapping's ``LOCK_SH``, or a creation's."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


_PID_MAX_LIMIT = 1 << 22  # the kernel's ceiling for pid_max: a larger "pid" is no pid pinpool wrote
_UNIX_MAX = 1 << 40  # seconds: year 36812


def _number(value: object, low: int, high: int) -> int | float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high:
        return value
    return None


def region_info(path: str, st: os.stat_result, trailer: Trailer) -> RegionInfo:
    created = trailer.created
    host, start = created.get("host"), created.get("start")
    pid = _number(created.get("pid"), 1, _PID_MAX_LIMIT)
    alive: bool | None = None
    if isinstance(pid, int) and host == socket.gethostname():
        alive = start is not None and _process_start(pid) == start
    unix = _number(created.get("unix"), 1, _UNIX_MAX)
    return RegionInfo(
        path=path, file_bytes=st.st_size, nbytes=trailer.nbytes, page_size=trailer.page_size,
        held_bytes=st.st_blocks * 512, owner_uid=st.st_uid, version=trailer.version, generation=trailer.generation,
        region_id=trailer.region_id, keep=bool(trailer.flags & FLAG_KEEP), record=trailer.record,
        created_pid=pid if isinstance(pid, int) else None,
        created_host=host if isinstance(host, str) else None, creator_alive=alive,
        age_seconds=None if unix is None else max(0.0, time.time() - unix),
    )  # fmt: skip


def open_checked(name: str, dir_fd: int | None, flags: int, refuse: Callable[[os.stat_result], object]) -> int | None:
    """``name`` opened, or None where it cannot be or ``refuse`` faults its ``lstat`` (opening a
    device has effects) or, once open, its ``fstat`` (it may have been swapped)."""
    try:
        if refuse(os.stat(name, dir_fd=dir_fd, follow_symlinks=False)):
            return None
        fd = os.open(name, flags | FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    with contextlib.suppress(OSError):
        if not refuse(os.fstat(fd)):
            return fd
    os.close(fd)
    return None


Suspects = Callable[..., "tuple[range, ...] | None"]  # intents.suspects_in: (fd, file_bytes, where, *, page_size)


def read_region(path: str, *, dir_fd: int | None = None, suspects: Suspects | None = None) -> RegionInfo | None:
    """What the file at ``path`` (in ``dir_fd``, if given) holds, or None for no readable region; ``suspects``
    reads the pages dead writers left marked (intents.suspects_in; passed in: intents reads with this module)."""
    name = path if dir_fd is None else os.path.basename(path)
    if (fd := open_checked(name, dir_fd, os.O_RDONLY, lambda st: not stat.S_ISREG(st.st_mode))) is None:
        return None
    try:
        st = os.fstat(fd)
        info = region_info(path, st, read_trailer(fd, st.st_size))
        marked = None if suspects is None else suspects(fd, st.st_size, path, page_size=info.page_size)
        return dataclasses.replace(info, in_use=_in_use(fd), suspect_pages=marked)
    except (OSError, NotRegion):
        return None
    finally:
        os.close(fd)


def region_directories(mounts: str = "/proc/mounts") -> list[str]:
    """Where regions live: ``/dev/shm`` and every hugetlbfs mount point."""
    found = ["/dev/shm"]
    with contextlib.suppress(OSError), open(mounts) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "hugetlbfs":
                point = parts[1].replace("\\040", " ")
                if point not in found:
                    found.append(point)
    return found


@dataclass(frozen=True)
class HalfMade:
    """A region's temporary file: ``in_progress`` while its creator holds its lock, else a dead one's."""

    path: str
    held_bytes: int
    in_progress: bool


def _files(directories: Iterable[str] | None) -> Iterator[os.DirEntry[str]]:
    """Regular files in ``directories`` and their subdirectories (never through a link), a bounded scan."""
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


def find_regions(directories: Iterable[str] | None = None, *, suspects: Suspects | None = None) -> list[RegionInfo]:
    """Every pinpool region in ``directories`` and their subdirectories: an ``lstat``, at most a ``pread`` each."""
    regions: list[RegionInfo] = []
    for entry in _files(directories):
        try:
            if is_temp_name(entry.name) or entry.stat(follow_symlinks=False).st_size < 2 * TRAILER_BYTES:
                continue
        except OSError:
            continue
        if (info := read_region(entry.path, suspects=suspects)) is not None:
            regions.append(info)
    return sorted(regions, key=lambda r: r.path)


def find_half_made(directories: Iterable[str] | None = None) -> list[HalfMade]:
    """Every region's temporary file in ``directories``, as :func:`find_regions` looks."""
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
