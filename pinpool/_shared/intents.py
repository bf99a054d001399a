"""Write intents: which pages of a shared region a writer that died may have been writing
(docs/shared-memory.md, "After a crash").

A writer marks a run of the pool's pages in one of the trailer's intent slots before its first
store to them and clears the mark after its last; it holds an open-file-description lock
(``F_OFD_SETLK``) on its slot meanwhile, which the kernel drops when the process dies. A marked slot
nobody holds is a dead writer's: its pages are *suspect*. Every mark and clear is one ``pwrite`` of
16 bytes inside one page: the kernel copies it whole before a SIGKILL takes effect, so a slot holds
the old or the new value, never half; a slot whose checksum does not match (written by something
else) makes every page suspect."""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import weakref
import zlib
from collections.abc import Iterator

from .._errors import ConfigError, PoolStateError
from .format import (
    FLAG_INTENTS,
    INTENT_SLOT_BYTES,
    INTENT_SLOTS,
    INTENTS_AT,
    TRAILER_BYTES,
    NotRegion,
    read_field,
    read_trailer,
    write_field,
)
from .ofd import let_go_at_fork, ofd_lock, reopen

_SLOT = struct.Struct("<QII")  # first page, page count, CRC-32 of the first 12 bytes
_EMPTY = bytes(INTENT_SLOT_BYTES)


def _encode(first: int, count: int) -> bytes:
    head = struct.pack("<QI", first, count)
    return head + zlib.crc32(head).to_bytes(4, "little")


def _decode(raw: bytes) -> range | None:
    """The slot's page run; None for an empty slot; ValueError for one pinpool did not write."""
    if raw == _EMPTY:
        return None
    first, count, crc = _SLOT.unpack(raw)
    if crc != zlib.crc32(raw[:12]) or count == 0:
        raise ValueError("a write-intent slot holds what pinpool did not write")
    return range(first, first + count)


def _lock(fd: int, start: int, kind: int, *, test: bool = False) -> bool:
    """:func:`ofd_lock` of ``kind`` on the slot at ``start`` of the file (``test``: held by another open file)."""
    return ofd_lock(fd, start, INTENT_SLOT_BYTES, kind, test=test)


class Intents:
    """The write intents of one region mapped by this process (one open file description)."""

    def __init__(self, fd: int, file_bytes: int, where: str, *, page_size: int) -> None:
        try:
            trailer = read_trailer(fd, file_bytes)
        except NotRegion as exc:
            raise ConfigError(f"shared memory {where} {exc.problem}") from None
        if not trailer.flags & FLAG_INTENTS:
            raise ConfigError(
                f"shared memory {where} has no room for write intents: made by a pinpool before them, or its "
                "description fills its trailer; create the region again with this pinpool"
            )
        # An open file of its own: a descriptor handed on (fd=, a memfd passed to another process) shares
        # its open file, so its OFD locks, with every process holding it; each Intents' locks are its own.
        fd = reopen(fd, where, "write intents")
        self._close = weakref.finalize(self, os.close, fd)
        let_go_at_fork(self)
        pages = trailer.record.get("num_pages")
        self.num_pages = pages if isinstance(pages, int) and not isinstance(pages, bool) and pages > 0 else None
        self._fd, self._file_bytes, self._where, self._page_size = fd, file_bytes, where, page_size
        self._base = file_bytes - TRAILER_BYTES + INTENTS_AT  # the first slot's file offset
        self._pid = os.getpid()
        self._mine: set[int] = set()  # slots this process holds: its threads share one lock owner
        self._lock = threading.Lock()

    def let_go_in_child(self) -> None:
        """A forked child reads through an open file of its own: the inherited one shares the parent's slot locks,
        and would keep a dead parent's marks looking live for as long as the child lives. It writes nothing."""
        self._close.detach()
        inherited, self._fd = self._fd, -1
        with contextlib.suppress(OSError):
            self._fd = os.open(f"/proc/self/fd/{inherited}", os.O_RDWR | os.O_CLOEXEC)
            self._close = weakref.finalize(self, os.close, self._fd)
        with contextlib.suppress(OSError):
            os.close(inherited)
        self._mine, self._lock = set(), threading.Lock()  # the parent's slots, and a lock a thread held at the fork

    def _read(self, slot: int) -> bytes:
        at = INTENTS_AT + slot * INTENT_SLOT_BYTES
        return read_field(self._fd, self._file_bytes, at, INTENT_SLOT_BYTES, self._where)

    def _write(self, slot: int, data: bytes) -> None:
        at = INTENTS_AT + slot * INTENT_SLOT_BYTES
        write_field(self._fd, self._file_bytes, at, data, self._where, page_size=self._page_size)

    def check_run(self, first: int, count: int) -> None:
        for name, value in (("first_page", first), ("count", count)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"writing({name}={value!r}): must be an int >= 0")
        if count == 0 or count >= 1 << 32 or first >= 1 << 63:
            raise ConfigError(f"writing(first_page={first}, count={count}): count must be in [1, 2**32)")
        if self.num_pages is not None and first + count > self.num_pages:
            raise ConfigError(
                f"writing(first_page={first}, count={count}): pages [{first}, {first + count}) are not all in "
                f"the region's {self.num_pages} pages"
            )

    def _claim(self) -> int:
        """A free slot, locked: never one that holds a dead writer's mark (its evidence stays until cleared)."""
        if os.getpid() != self._pid:
            raise PoolStateError(
                "writing() in a process forked from the one that mapped the region: its lock owner is the "
                "parent's; map the region in this process (SharedMemory(path, create=False)) to write"
            )
        with self._lock:
            for slot in range(INTENT_SLOTS):
                if slot in self._mine or not _lock(self._fd, self._base + slot * INTENT_SLOT_BYTES, fcntl.F_WRLCK):
                    continue
                if self._read(slot) == _EMPTY:
                    self._mine.add(slot)
                    return slot
                _lock(self._fd, self._base + slot * INTENT_SLOT_BYTES, fcntl.F_UNLCK)  # a dead writer's mark
        raise PoolStateError(
            f"shared memory {self._where}: all {INTENT_SLOTS} write-intent slots are held by writers now or by "
            "dead writers' marks: fewer concurrent writing() blocks, or clear_suspect_pages() after a crash"
        )

    def _release(self, slot: int) -> None:
        with self._lock:
            _lock(self._fd, self._base + slot * INTENT_SLOT_BYTES, fcntl.F_UNLCK)
            self._mine.discard(slot)

    @contextlib.contextmanager
    def writing(self, first: int, count: int) -> Iterator[None]:
        self.check_run(first, count)
        slot = self._claim()
        try:
            self._write(slot, _encode(first, count))  # before the caller's first store to these pages
            try:
                yield
            finally:
                self._write(slot, _EMPTY)  # after its last; a SIGKILL before this leaves the mark
        finally:
            self._release(slot)

    def suspects(self, *, clear: bool) -> tuple[range, ...]:
        """The page runs dead writers' marks hold (all pages for a slot pinpool did not write); ``clear``:
        empty those slots (each under its lock, so never a live writer's)."""
        found: list[range] = []
        with self._lock:
            every = read_field(self._fd, self._file_bytes, INTENTS_AT, INTENT_SLOTS * INTENT_SLOT_BYTES, self._where)
            for slot in range(INTENT_SLOTS):
                if every[slot * INTENT_SLOT_BYTES : (slot + 1) * INTENT_SLOT_BYTES] == _EMPTY:
                    continue  # read again below only where a mark may be
                start = self._base + slot * INTENT_SLOT_BYTES
                if slot in self._mine or _lock(self._fd, start, fcntl.F_WRLCK, test=True):
                    continue  # a live writer's: its pages are being written now, not suspect
                if clear and not _lock(self._fd, start, fcntl.F_WRLCK):
                    continue  # taken meanwhile by a live writer
                try:
                    try:
                        run = _decode(self._read(slot))
                    except ValueError:
                        run = range(0, self.num_pages or 1 << 63)  # not knowable: every page
                    if run is not None:
                        found.append(run)
                        if clear:
                            self._write(slot, _EMPTY)
                finally:
                    if clear:
                        _lock(self._fd, start, fcntl.F_UNLCK)
        return tuple(sorted(found, key=lambda r: (r.start, r.stop)))


def suspects_in(fd: int, file_bytes: int, where: str, *, page_size: int) -> tuple[range, ...] | None:
    """:meth:`Intents.suspects` of an open region file, or None where it has no intents or cannot tell."""
    try:
        return Intents(fd, file_bytes, where, page_size=page_size).suspects(clear=False)
    except (ConfigError, OSError):
        return None
