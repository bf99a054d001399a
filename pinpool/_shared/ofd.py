"""Open-file-description locks on a region's file (``F_OFD_SETLK``): the primitive the write intents use, and
the *attachers'* lock, which tells a give-back whether another process maps the region (docs/shared-memory.md,
"Giving pages back when several processes map a region").

Every mapping of a region holds a read lock on one byte far past the file's end (:data:`ATTACHERS_AT`: no
lock of the write intents, which lie inside the trailer, can overlap it; ``flock`` locks are independent of
``fcntl`` locks on Linux) for its whole mapped life, through an open file of its own (a descriptor handed to
another process shares its open file, so its locks, with every process holding it). A give-back converts that
lock to a write lock without waiting: the kernel grants it only when no other open file holds a lock there,
that is when no other mapping exists; a conversion refused keeps the read lock (verified by a test). The hole
is punched under the write lock; a mapping made meanwhile waits at its read lock (a punch is bounded: about
0.3 s per GiB) and then finds the hole. A forked child is no attacher: it closes its copy of the descriptor
at the fork (the lock lives with the parent's), and never gives pages back."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import threading
import weakref
from collections.abc import Iterator
from typing import Protocol

from .._errors import ConfigError

_FLOCK = struct.Struct("hhqqi4x")  # struct flock: type, whence, start, len, pid (0 for OFD locks)
# The last byte an OFD lock may start at whose end fits in an off_t: past any region's end (sizes < 2**62).
ATTACHERS_AT = (1 << 63) - 2


def ofd_lock(fd: int, start: int, length: int, kind: int, *, wait: bool = False, test: bool = False) -> bool:
    """``F_OFD_SETLK`` (``wait``: ``F_OFD_SETLKW``) ``kind`` on ``[start, +length)`` of the file: whether taken;
    with ``test``, ``F_OFD_GETLK``: whether another open file holds a lock there that ``kind`` conflicts with."""
    arg = _FLOCK.pack(kind, os.SEEK_SET, start, length, 0)
    command = fcntl.F_OFD_GETLK if test else fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        got = fcntl.fcntl(fd, command, arg)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK if test else True


def reopen(fd: int, where: str, why: str) -> int:
    """An open file of this process's own for the file ``fd`` refers to (``/proc/self/fd``): its OFD locks are
    this opening's alone, whoever else holds ``fd``'s open file."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(
            f"shared memory {where}: {why} need the region opened again through /proc/self/fd "
            f"({exc.strerror or exc}); mount /proc"
        ) from None


class Attachers:
    """This mapping's mark as an attacher of its region: a read lock on :data:`ATTACHERS_AT`, taken (waiting
    for a punch under way in another process) before the region is mapped, dropped by :meth:`close`."""

    def __init__(self, fd: int, where: str) -> None:
        self.fd = reopen(fd, where, "its mappings")
        # Closed with this object at the latest: an open file left holding the lock would keep every give-back of
        # the region refused until this process exits. Never at exit: the mapping stays until the process is gone.
        self._close = weakref.finalize(self, _close, self.fd)
        self._close.atexit = False
        self._punching = threading.Lock()  # the conversion is the open file's: one give-back of this mapping at once
        let_go_at_fork(self)  # before the lock: a fork while it waits for a punch elsewhere must not keep it
        ofd_lock(self.fd, ATTACHERS_AT, 1, fcntl.F_RDLCK, wait=True)

    @contextlib.contextmanager
    def alone(self) -> Iterator[bool]:
        """Whether no other open file holds the lock (no other process maps the region), held so for the block:
        no mapping is made meanwhile. Back to the read lock after it. Never in a forked child: the region's
        pages are its parent's (it let go of its copy of the lock at the fork)."""
        if self.fd < 0:
            yield False
            return
        with self._punching:
            try:
                yield ofd_lock(self.fd, ATTACHERS_AT, 1, fcntl.F_WRLCK)
            finally:  # whatever came between (a Ctrl-C), a write lock left would stall every attach elsewhere
                ofd_lock(self.fd, ATTACHERS_AT, 1, fcntl.F_RDLCK, wait=True)  # never waits: a no-op, or a downgrade

    def close(self) -> None:
        self._close()

    def let_go_in_child(self) -> None:
        """A forked child's copy of the descriptor: closed, so the lock lives with the parent's alone (an open
        file's OFD lock lasts until its last descriptor goes: a child outliving its parent's mapping would keep
        every later give-back of the region refused)."""
        if self._close.detach() is not None:
            _close(self.fd)
        self.fd = -1


class _LetsGoInChild(Protocol):
    def let_go_in_child(self) -> None: ...


_LIVE: weakref.WeakSet[_LetsGoInChild] = weakref.WeakSet()


def let_go_at_fork(holder: _LetsGoInChild) -> None:
    """``holder.let_go_in_child()`` runs in every process forked from this one while it lives: an open file of
    its own holding OFD locks must not be shared with a child (the locks would live as long as the child)."""
    _LIVE.add(holder)


def _let_go_in_child() -> None:
    for holder in list(_LIVE):
        holder.let_go_in_child()


os.register_at_fork(after_in_child=_let_go_in_child)


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
