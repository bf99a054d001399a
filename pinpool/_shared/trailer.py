"""The on-disk format of a shared memory region (see :mod:`pinpool._shared.memory`): the file's layout,
the trailer that says what it holds, and :func:`layout_record`, the pool's description kept in it.

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
    24      8     generation                 the server's own counter (set_generation); not in the CRC
    32      8     reserved (0)
    40      ...   body: UTF-8 JSON {"nbytes", "page_size", "region_id", "record", "created": {"uid",
                  "pid", "start", "unix", "host"}}; "record" is the pool's description (layout_record())

``region_id``: 32 hex digits, random, new each time a region is created, so that a server's
index saved against one region never matches a later region at the same path (whose generation
starts again at 0). A region made before it existed reads as the hash of its body, which holds
the creator's pid, start time and creation time: also new each time.

A file that holds no region (or a newer format, or a corrupt trailer) reads as ``_NotRegion``,
which callers turn into a :class:`ConfigError` or skip. The trailer is *untrusted input* (any
process of the owner, or a file another user planted, may have written it): its body is parsed
with bounded nesting, integers only where integers belong, finite numbers, and printable text
only, so a bad one is ``_NotRegion``, never a RecursionError, an OverflowError or an escape
sequence on an operator's terminal.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import secrets
import socket
import struct
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError
from .._host import libc as _libc
from .._units import format_bytes

if TYPE_CHECKING:
    from ..layouts import Layout

__all__ = ["FLAG_KEEP", "FORMAT_VERSION", "MAGIC", "TRAILER_BYTES", "layout_record"]

MAGIC = b"pinpoolR"
FORMAT_VERSION = 1
TRAILER_BYTES = 4096
_FIXED = struct.Struct("<8sIIIIQQ")  # magic, version, body length, body CRC, flags, generation, reserved
_BODY_AT = _FIXED.size  # 40
_MAX_BODY = TRAILER_BYTES - _BODY_AT
_FLAGS_AT = 20
_GENERATION_AT = 24
FLAG_KEEP = 1
_PAGE = _libc.PAGE_SIZE
_MAX_DEPTH = 8  # the body nests 5 deep (body, record, buffers, a buffer, its shape)
_MAX_SIZE = 1 << 62  # larger than any host's memory, small enough for every later sum


def _align(n: int, page: int) -> int:
    return -(-n // page) * page


def _file_bytes(nbytes: int, page_size: int) -> int:
    """The size of a region file holding ``nbytes``: the data rounded to pages, plus the trailer's page."""
    return _align(nbytes, page_size) + page_size


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
    def region_id(self) -> str:
        return str(self.body["region_id"])

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
    fields = {
        "nbytes": nbytes, "page_size": page_size, "region_id": new_region_id(), "record": json.loads(record_json),
        "created": created,
    }  # fmt: skip
    problem = _untrusted_problem(fields, 1)
    if problem is not None:
        raise ConfigError(f"the pool's description cannot be kept in a shared memory trailer: {problem}")
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    if len(body) > _MAX_BODY:
        raise ConfigError(
            f"the pool's description for its shared memory trailer is {len(body)} bytes, more than the "
            f"{_MAX_BODY} a trailer holds: a layout with fewer buffers (or shorter names) is needed"
        )
    return body


def new_region_id() -> str:
    """A region's identity: 128 random bits, new at each creation."""
    return secrets.token_hex(16)


def _printable(text: str) -> bool:
    return text.isprintable() and text.isascii()


def _untrusted_problem(value: object, depth: int) -> str | None:
    """Why a parsed (or to be written) body is not one pinpool reads, or None: nesting beyond
    :data:`_MAX_DEPTH`, a number that is not finite, or text that is not printable ASCII (which
    would reach terminals and logs)."""
    if depth > _MAX_DEPTH:
        return f"it nests more than {_MAX_DEPTH} deep"
    if isinstance(value, str):
        return None if _printable(value) else f"the text {ascii(value)[:60]} is not printable ASCII"
    if isinstance(value, float):
        return None if math.isfinite(value) else "a number is not finite"
    if isinstance(value, dict):
        items: list[object] = [*value.keys(), *value.values()]
    elif isinstance(value, list):
        items = value
    else:
        return None
    return next((p for p in (_untrusted_problem(v, depth + 1) for v in items) if p is not None), None)


def _nesting(body: bytes) -> int:
    """The deepest nesting of ``[`` and ``{`` outside strings: checked before ``json.loads``,
    whose recursion a body of 4,000 brackets would exhaust."""
    depth = deepest = 0
    quoted = escaped = False
    for byte in body:
        if quoted:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                quoted = False
        elif byte == 0x22:
            quoted = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
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
    problem = _untrusted_problem(parsed, 1)
    if problem is not None:
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
        parsed = _parse_body(body)
    except (ValueError, UnicodeDecodeError) as exc:  # json.JSONDecodeError and int-digit limits are ValueErrors
        raise _NotRegion(f"has a corrupt pinpool trailer (its description cannot be read: {exc})") from None
    return _Trailer(version, flags, generation, parsed)


def _read_trailer(fd: int, file_bytes: int) -> _Trailer:
    """The trailer of the open file (``pread``: hugetlbfs files can be read, and a hole reads as zeros)."""
    if file_bytes < 2 * TRAILER_BYTES:
        if file_bytes == 0:
            raise _NotRegion("is empty: not initialised yet", uninitialised=True)
        raise _NotRegion(f"is too small ({file_bytes} bytes) for a pinpool region")
    return _parse_trailer(os.pread(fd, TRAILER_BYTES, file_bytes - TRAILER_BYTES))


def _trailer_bytes(body: bytes, *, keep: bool) -> bytes:
    """A whole trailer (4 KiB) holding ``body``."""
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, len(body), zlib.crc32(body), FLAG_KEEP if keep else 0, 0, 0)
    return (head + body).ljust(TRAILER_BYTES, b"\0")


def _checked_size(fd: int, file_bytes: int, where: str) -> None:
    """:class:`ConfigError` unless the file is still ``file_bytes`` long: another process of the
    owner may truncate or grow it, and touching a mapped page past its end is SIGBUS."""
    size = os.fstat(fd).st_size
    if size != file_bytes:
        raise ConfigError(
            f"shared memory {where} is {size} bytes now, not the {file_bytes} its region was made with: another "
            "process truncated or resized it, so its pages past the end are gone and the region cannot be used; "
            "stop the pool, remove the file (`rm` it) and create the region again"
        )


def read_field(fd: int, file_bytes: int, at: int, size: int, where: str) -> bytes:
    """``size`` bytes at ``at`` of the trailer, read with ``pread`` after checking the file's size:
    never through a mapping, so a truncation is a :class:`ConfigError`, never SIGBUS."""
    _checked_size(fd, file_bytes, where)
    raw = os.pread(fd, size, file_bytes - TRAILER_BYTES + at)
    if len(raw) != size:  # truncated between the check and the read
        _checked_size(fd, file_bytes, where)
        raise ConfigError(f"shared memory {where}: its trailer could not be read ({len(raw)} of {size} bytes)")
    return raw


def write_field(fd: int, file_bytes: int, at: int, data: bytes, where: str, *, page_size: int) -> None:
    """Write ``data`` at ``at`` of the trailer after checking the file's size: ``pwrite`` on tmpfs
    and memfds (a truncation is a :class:`ConfigError`, never SIGBUS); hugetlbfs files cannot be
    written, so there through a mapping of the trailer's page, stored through ``/proc/self/mem``
    (a truncation since the check is EIO there, never SIGBUS)."""
    _checked_size(fd, file_bytes, where)
    store(fd, file_bytes, at, data, where, page_size=page_size)


def store(fd: int, file_bytes: int, at: int, data: bytes, where: str, *, page_size: int) -> None:
    """Write ``data`` at ``at`` of the trailer of a file of ``file_bytes``: ``pwrite``, or on
    hugetlbfs (whose files cannot be written) through a mapping of the trailer's page."""
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
    """Store into our own mapping through ``/proc/self/mem``: the kernel answers a page beyond the
    file's end (another process truncated it since the size check) with EIO, not SIGBUS. Where
    ``/proc`` is not there or is closed to us, a plain store (the one SIGBUS window left)."""
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
