"""The on-disk format of a shared memory region (see :mod:`pinpool._shared`): the file's layout,
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
    40      ...   body: UTF-8 JSON {"nbytes", "page_size", "record", "created": {"uid", "pid",
                  "start", "unix", "host"}}; "record" is the pool's description (layout_record())

A file that holds no region (or a newer format, or a corrupt trailer) reads as ``_NotRegion``,
which callers turn into a :class:`ConfigError` or skip.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import struct
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import ConfigError
from ._units import format_bytes

if TYPE_CHECKING:
    from .layouts import Layout

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
