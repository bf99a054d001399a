"""Node pacing's flock holds and what its lock files record.

A hold (:class:`SlotHold`, :class:`BudgetHold`) owns the descriptor of one lock file whose
``flock(LOCK_EX)`` it holds. A flock belongs to an open file description and the kernel drops
it when the last descriptor to that description is closed, which includes the holder's death by
SIGKILL: nothing a crashed rank held stays held. A hold releases once (``release()`` is
idempotent), is a context manager, and releases itself when collected. The files are
``slot-<i>`` (a pin slot), ``hold-<pid>-<random>`` (bytes of the budget) and ``budget.lock``;
each slot and hold file records its holder (:func:`_record`: a first line, the pid, the pool's
label) for others' messages only, read back as a :class:`NodeHolder`.

**Fork**: descriptors are opened ``O_CLOEXEC``, so an ``exec``'d child gets none. A child forked
without ``exec`` inherits them, and with them the parent's open file descriptions, which would
keep the parent's slot locked after the parent releases it, for as long as the child lives. So,
in a forked child, every hold inherited from the parent is forgotten at fork
(``os.register_at_fork``): the child closes its copies of the descriptors, which never releases
the lock (the parent's descriptor still refers to the description), and marks the hold as
released; ``release()`` of a hold in any process but the one that acquired it does nothing, and
never removes the parent's hold file.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

from .._units import format_bytes

__all__ = ["BudgetHold", "NodeHolder", "SlotHold", "holder_state"]

HolderState = Literal["running", "stopped", "zombie", "not found", "unknown"]

_SLOT_PREFIX = "slot-"
_HOLD_PREFIX = "hold-"
_BUDGET_LOCK = "budget.lock"
_RECORD_LIMIT = 512  # bytes read back from a slot or hold file


# -- who holds what --------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeHolder:
    """Who holds a slot or part of the budget, as its file says: pid (None if unreadable), bytes
    (budget only) and the holder's label (its pool's name). ``state`` is None unless looked up
    (what a waiting rank reports, see :func:`holder_state`)."""

    pid: int | None
    nbytes: int | None = None
    label: str = ""
    state: HolderState | None = None

    def describe(self) -> str:
        who = "pid ?" if self.pid is None else f"pid {self.pid}"
        if self.label:
            who += f" (pool {self.label!r})"
        if self.state is not None:
            who += f" [{self.state}]"
        return who if self.nbytes is None else f"{who}: {format_bytes(self.nbytes)}"


def holder_state(pid: int | None, proc: str = "/proc") -> HolderState:
    """Whether ``pid`` runs (or sleeps), is stopped (``T``/``t``: SIGSTOP, a debugger), is a zombie,
    is not found here (gone, or in another pid namespace), or cannot be told: one read of
    ``/proc/<pid>/stat``."""
    if pid is None or pid <= 0:
        return "unknown"
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            data = f.read(4096)
    except FileNotFoundError:
        return "not found"
    except OSError:
        return "unknown"
    fields = data.rpartition(b")")[2].split()  # the command name, in parentheses, may hold anything
    if not fields:
        return "unknown"
    code = fields[0]
    if code in (b"T", b"t"):
        return "stopped"
    if code in (b"Z", b"X", b"x"):
        return "zombie"
    return "running"


def _flock_holders(st: os.stat_result, locks: str = "/proc/locks") -> tuple[int, ...]:
    """The pids holding a flock on the file ``st`` describes, as ``/proc/locks`` says (pids of
    this pid namespace; empty when unreadable). Read only when a wait is reported."""
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    pids: list[int] = []
    try:
        with open(locks) as f:
            for line in f:
                # "7: FLOCK  ADVISORY  WRITE 4242 00:1b:1234 0 EOF" (a waiter's line has "->" after the number)
                parts = line.split()
                if len(parts) < 6 or parts[1] != "FLOCK":
                    continue
                try:
                    major, minor, inode = parts[5].split(":")
                    if (int(major, 16), int(minor, 16), int(inode)) == want and int(parts[4]) > 0:
                        pids.append(int(parts[4]))
                except ValueError:
                    continue
    except OSError:
        return ()
    return tuple(dict.fromkeys(pids))


def _record(pid: int, first: str, label: str) -> bytes:
    clean = "".join(c if c.isprintable() else " " for c in label)[:200]
    return f"{first}\n{pid}\n{clean}\n".encode()


def _read_record(fd: int) -> tuple[str, int | None, str]:
    """``(first line, pid, label)`` of a slot or hold file; blanks for whatever is unreadable."""
    try:
        lines = os.pread(fd, _RECORD_LIMIT, 0).decode("utf-8", "replace").split("\n")
    except OSError:
        return "", None, ""
    first = lines[0] if lines else ""
    pid = int(lines[1]) if len(lines) > 1 and lines[1].isascii() and lines[1].isdigit() else None
    label = lines[2] if len(lines) > 2 else ""
    return first, pid, label


# -- holds -----------------------------------------------------------------------------------------

_LIVE: weakref.WeakSet[_Hold] = weakref.WeakSet()


class _Hold:
    """A lock file's descriptor. Released once, in the process that acquired it; forgotten in a forked child.

    A hold is made before anything is opened and owns each descriptor from the single attribute
    store that keeps it (``hold._fd = os.open(...)``): whatever is raised afterwards (an error, a
    ``KeyboardInterrupt``), the acquiring code calls :meth:`release`, and a hold that is dropped
    unreleased releases itself when collected (at once, by reference counting). The only window
    left is between ``open`` returning and that store, when the descriptor holds no lock yet.
    """

    def __init__(self, *, directory: str, name: str | None, waited_seconds: float) -> None:
        self._fd = -1
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.directory = directory
        self.name = name  # the file's name in the directory, None for a hold of no pacing
        self.waited_seconds = waited_seconds

    @property
    def released(self) -> bool:
        """True once released (and from the start for a hold of no pacing, or in a forked child)."""
        return self._fd < 0

    def release(self) -> None:
        """Give the hold back (idempotent; a no-op in any process but the one that acquired it)."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            fd, self._fd = self._fd, -1
            if fd >= 0:
                _LIVE.discard(self)
            try:
                self._undo(owned=fd >= 0)
            finally:
                if fd >= 0:
                    os.close(fd)  # drops the flock: the last descriptor of its open file description

    def _undo(self, *, owned: bool) -> None:
        """What to do before the descriptor is closed (the budget removes its hold file)."""

    def _forget_in_child(self) -> None:
        """In a forked child: close the inherited copy (never releases the parent's lock) and never touch it again."""
        fd, self._fd = self._fd, -1
        self._lock = threading.Lock()
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> _Hold:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


def _forget_all_in_child() -> None:
    for hold in list(_LIVE):
        hold._forget_in_child()
    _LIVE.clear()


os.register_at_fork(after_in_child=_forget_all_in_child)


class SlotHold(_Hold):
    """One of the node's pin slots (``index``; None when slots are not paced). Hold it only while pinning."""

    def __init__(self, *, directory: str, index: int | None, waited_seconds: float) -> None:
        name = None if index is None else f"{_SLOT_PREFIX}{index}"
        super().__init__(directory=directory, name=name, waited_seconds=waited_seconds)
        self.index = index

    def __enter__(self) -> SlotHold:
        return self

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<SlotHold {self.name} in {self.directory!r} {state} waited={self.waited_seconds:.3f}s>"


class BudgetHold(_Hold):
    """``nbytes`` of the node's byte budget (``name`` None when the budget is not paced). Hold it for
    as long as the memory is pinned: from before pinning until after unpinning."""

    def __init__(self, *, directory: str, name: str | None, nbytes: int, waited_seconds: float) -> None:
        self._dir_fd = -1  # the directory, to remove the hold file by name (never by a path that could be swapped)
        super().__init__(directory=directory, name=name, waited_seconds=waited_seconds)
        self.nbytes = nbytes

    def _undo(self, *, owned: bool) -> None:
        dir_fd, self._dir_fd = self._dir_fd, -1
        if dir_fd < 0:
            return
        try:
            if owned and self.name is not None:
                os.unlink(self.name, dir_fd=dir_fd)  # still locked: nobody counts it as stale meanwhile
        except FileNotFoundError:
            pass
        finally:
            os.close(dir_fd)

    def _forget_in_child(self) -> None:
        dir_fd, self._dir_fd = self._dir_fd, -1
        if dir_fd >= 0:
            try:
                os.close(dir_fd)
            except OSError:
                pass
        super()._forget_in_child()

    def __enter__(self) -> BudgetHold:
        return self

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return (
            f"<BudgetHold {format_bytes(self.nbytes)} {self.name} in {self.directory!r} {state} "
            f"waited={self.waited_seconds:.3f}s>"
        )
