"""Node pacing: ranks on one host share pin slots and a byte budget through ``flock(2)``-ed files in
one directory (docs/serving.md); a dead rank's locks go with it. **Slots**: ``LOCK_EX`` on the first
free ``slot-N``. **Budget**: each holder keeps a locked ``hold-<pid>-<random>`` holding its byte count;
admission, under ``LOCK_EX`` on ``budget.lock``, sums the locked ones (removing dead holders') and
creates its own if the request fits. ``slot-N`` and ``budget.lock`` are never removed (that would split a lock)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar, Literal, Self, TypeVar, cast

from .._errors import ConfigError, Kind, NodeBusyError, NodeWaitCancelled
from .._host.files import FILE_FLAGS
from .._units import format_bytes
from .config import BUDGET_ENV, SLOTS_ENV, NodePacing, file_error, file_problem, open_directory, open_error, open_file

HolderState = Literal["running", "stopped", "zombie", "not found", "unknown"]

_SLOT_PREFIX = "slot-"
_HOLD_PREFIX = "hold-"
_BUDGET_LOCK = "budget.lock"
_RECORD_LIMIT = 512  # bytes read back from a slot or hold file


@dataclass(frozen=True)
class NodeHolder:
    """Who holds a slot or part of the budget (``nbytes``), as its file says; ``state``: see :func:`holder_state`."""

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


_STATES: dict[bytes, HolderState] = {b"T": "stopped", b"t": "stopped", b"Z": "zombie", b"X": "zombie", b"x": "zombie"}


def holder_state(pid: int | None, proc: str = "/proc") -> HolderState:
    """``pid``'s state, from one read of ``/proc/<pid>/stat`` ("not found": gone, or another pid namespace)."""
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
    return _STATES.get(fields[0], "running") if fields else "unknown"


def _flock_holders(st: os.stat_result, locks: str = "/proc/locks") -> tuple[int, ...]:
    """The pids (of this namespace) holding a flock on the file ``st`` describes, per ``/proc/locks``."""
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


def _read_record(fd: int) -> tuple[str, int | None, str]:
    """``(first line, pid, label)`` of a slot or hold file; blanks for whatever is unreadable."""
    try:
        first, pid, label, *_ = [*os.pread(fd, _RECORD_LIMIT, 0).decode("utf-8", "replace").split("\n"), "", ""]
    except OSError:
        return "", None, ""
    return first, int(pid) if pid.isascii() and pid.isdigit() else None, label


# -- holds -----------------------------------------------------------------------------------------


class _Hold:
    """A lock file's descriptor, released once (also when collected), in the acquiring process only;
    made before anything is opened, so whatever is raised afterwards is undone by :meth:`release`."""

    live: ClassVar[weakref.WeakSet[_Hold]] = weakref.WeakSet()  # the holds not released: closed in a forked child

    def __init__(self, *, directory: str, name: str | None, waited_seconds: float) -> None:
        self._fd = self._dir_fd = -1  # the budget's: the directory, to remove its hold file by name
        self._pid = os.getpid()
        self._shown = ""  # what a repr names first
        self._lock = threading.Lock()
        self.directory = directory
        self.name = name  # the file's name in the directory, None for a hold of no pacing
        self.waited_seconds = waited_seconds

    @property
    def released(self) -> bool:  # from the start for a hold of no pacing, or in a forked child
        return self._fd < 0

    def release(self) -> None:
        if os.getpid() != self._pid:
            return
        with self._lock:
            fd, self._fd = self._fd, -1
            if fd >= 0:
                self.live.discard(self)
            try:
                self._undo(owned=fd >= 0)
            finally:
                if fd >= 0:
                    os.close(fd)  # drops the flock: the last descriptor of its open file description

    @staticmethod
    def record(first: str, label: str) -> bytes:
        """The file's text, which others' messages show: ``first`` (a kind or a byte count), our pid, the label."""
        clean = "".join(c if c.isprintable() else " " for c in label)[:200]
        return f"{first}\n{os.getpid()}\n{clean}\n".encode()

    def _undo(self, *, owned: bool) -> None:
        """Before the descriptor is closed (the budget removes its hold file)."""

    def _forget_in_child(self) -> None:
        """In a forked child: close the inherited copies (never releases the parent's lock)."""
        fds, self._fd, self._dir_fd = (self._fd, self._dir_fd), -1, -1
        self._lock = threading.Lock()
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        where = f"{self.name} in {self.directory!r} {state} waited={self.waited_seconds:.3f}s"
        return f"<{type(self).__name__} {self._shown}{where}>"


def _forget_all_in_child() -> None:
    for hold in list(_Hold.live):
        hold._forget_in_child()
    _Hold.live.clear()


os.register_at_fork(after_in_child=_forget_all_in_child)


class SlotHold(_Hold):
    """One of the node's pin slots (``index``; None when slots are not paced). Hold it only while pinning."""

    def __init__(self, *, directory: str, index: int | None, waited_seconds: float) -> None:
        name = None if index is None else f"{_SLOT_PREFIX}{index}"
        super().__init__(directory=directory, name=name, waited_seconds=waited_seconds)
        self.index = index


class BudgetHold(_Hold):
    """``nbytes`` of the node's byte budget (``name`` None when not paced), held while the memory is pinned."""

    def __init__(self, *, directory: str, name: str | None, nbytes: int, waited_seconds: float) -> None:
        super().__init__(directory=directory, name=name, waited_seconds=waited_seconds)
        self.nbytes = nbytes
        self._shown = f"{format_bytes(nbytes)} "

    def _undo(self, *, owned: bool) -> None:
        dir_fd, self._dir_fd = self._dir_fd, -1
        if dir_fd < 0:
            return
        try:
            if owned and self.name is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.name, dir_fd=dir_fd)  # still locked: nobody counts it as stale meanwhile
        finally:
            os.close(dir_fd)


# -- admission --------------------------------------------------------------------------------------

DEFAULT_POLL_SECONDS = 0.25  # the longest interval between two attempts while waiting
MIN_POLL_SECONDS = 0.005  # the first intervals
_POLL_FRACTION = 0.05  # of the time waited so far: a short pin's freed slot is taken within milliseconds
_LOCK_RETRY_SECONDS = 0.002  # budget.lock is held briefly; fail-fast gives up on it only after:
_LOCK_GIVE_UP_SECONDS = 5.0

H = TypeVar("H", bound=_Hold)


class _Contended:
    """budget.lock was busy: try again in a moment (not a verdict on the budget)."""


_CONTENDED = _Contended()


OnWaiting = Callable[[Kind, tuple[NodeHolder, ...], float], object]
OnWait = Callable[[NodeBusyError], object]
Cancelled = Callable[[], bool]
Attempt = Callable[[float], H | NodeBusyError | _Contended]  # one try, given the seconds waited so far


class NodeAdmission:
    """Admission to a node's pin slots and byte budget for one pool (``label``), checked when constructed.
    ``on_waiting(kind, holders, waited_seconds)``: called while waiting (what it raises is ignored)."""

    waiting_first_seconds = 10.0  # then every waiting_every_seconds, a waiting rank says whom it waits for
    waiting_every_seconds = 60.0

    def __init__(self, pacing: NodePacing, *, label: str = "", on_waiting: OnWaiting | None = None) -> None:
        if not isinstance(pacing, NodePacing):
            raise ConfigError(f"pacing={pacing!r} must be a NodePacing")
        if on_waiting is not None and not callable(on_waiting):
            raise ConfigError(f"on_waiting={on_waiting!r} must be callable(kind, holders, waited_seconds)")
        self.pacing = pacing
        self.label = label
        self.on_waiting = on_waiting
        dir_fd = open_directory(pacing.directory, probe=True)
        try:
            self._check_present(dir_fd)
        finally:
            os.close(dir_fd)

    def _check_present(self, dir_fd: int) -> None:
        """:class:`ConfigError` for a lock file of this pacing that is unusable (``lstat``: nothing opened)."""
        p = self.pacing
        for name in os.listdir(dir_fd):
            if name.startswith(_SLOT_PREFIX):
                index = name[len(_SLOT_PREFIX) :]
                if p.slots is None or not (index.isascii() and index.isdigit() and int(index) < p.slots):
                    continue
            elif not (p.budget_bytes is not None and (name == _BUDGET_LOCK or name.startswith(_HOLD_PREFIX))):
                continue
            try:
                problem = file_problem(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
            except FileNotFoundError:  # a hold file released meanwhile
                continue
            if problem is not None:
                raise file_error(p.directory, name, problem)

    def __repr__(self) -> str:
        p = self.pacing
        budget = None if p.budget_bytes is None else format_bytes(p.budget_bytes)
        return f"<NodeAdmission {p.directory!r} slots={p.slots} budget={budget} wait={p.wait}>"

    def _attempt_slot(self, waited: float) -> SlotHold | NodeBusyError:
        p = self.pacing
        if p.slots is None:
            return SlotHold(directory=p.directory, index=None, waited_seconds=0.0)
        holders: list[NodeHolder] = []
        dir_fd = open_directory(p.directory)
        try:
            for index in range(p.slots):
                hold = SlotHold(directory=p.directory, index=index, waited_seconds=waited)
                try:
                    hold._fd = open_file(dir_fd, p.directory, f"{_SLOT_PREFIX}{index}", os.O_RDWR | os.O_CREAT)
                    hold.live.add(hold)
                    try:
                        fcntl.flock(hold._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        _first, pid, label = _read_record(hold._fd)
                        holders.append(NodeHolder(pid=pid, label=label))
                        hold.release()  # closes a descriptor that holds no lock
                        continue
                    with contextlib.suppress(OSError):  # ours: say who holds it (for others' messages only)
                        os.ftruncate(hold._fd, 0)
                        os.pwrite(hold._fd, hold.record("slot", self.label), 0)
                    return hold
                except BaseException:
                    hold.release()
                    raise
        finally:
            os.close(dir_fd)
        listed = ", ".join(h.describe() for h in holders)
        return NodeBusyError(
            f"node pacing: all {p.slots} pin slot(s) in {p.directory!r} are taken (pinning now: {listed}); "
            f"nothing was pinned. Wait for a slot with node_wait=True, raise node_slots= / {SLOTS_ENV} "
            "(every rank must use the same value), or start this rank later",
            directory=p.directory, kind="slots", limit=p.slots, in_use=len(holders), holders=tuple(holders),
        )  # fmt: skip

    def check_request(self, nbytes: int) -> None:
        """:class:`ConfigError` unless ``nbytes`` is a positive int that fits the whole budget."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ConfigError(f"reserve_budget(nbytes={nbytes!r}): give a positive int number of bytes")
        budget = self.pacing.budget_bytes
        if budget is not None and nbytes > budget:
            raise ConfigError(
                f"a pool of {format_bytes(nbytes)} ({nbytes} B) can never fit the node budget of "
                f"{format_bytes(budget)} ({budget} B) in {self.pacing.directory!r}; raise node_budget= / "
                f"{BUDGET_ENV}, or pin a smaller pool"
            )

    def _attempt_budget(self, nbytes: int, waited: float) -> BudgetHold | NodeBusyError | _Contended:
        p = self.pacing
        budget = p.budget_bytes
        if budget is None:
            return BudgetHold(directory=p.directory, name=None, nbytes=nbytes, waited_seconds=0.0)
        dir_fd = open_directory(p.directory)
        try:
            lock_fd = open_file(dir_fd, p.directory, _BUDGET_LOCK, os.O_RDWR | os.O_CREAT)
            try:
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return _CONTENDED
                holders = self._live_holds(dir_fd)
                used = sum(h.nbytes or 0 for h in holders)
                if used + nbytes > budget:
                    listed = ", ".join(h.describe() for h in holders)
                    return NodeBusyError(
                        f"node pacing: pinning {format_bytes(nbytes)} would exceed the node budget of "
                        f"{format_bytes(budget)} in {p.directory!r}: {format_bytes(used)} is held ({listed}); "
                        f"nothing was pinned. Wait with node_wait=True, raise node_budget= / {BUDGET_ENV} (every "
                        "rank must use the same value), or pin a smaller pool",
                        directory=p.directory, kind="budget", limit=budget, in_use=used, requested=nbytes,
                        holders=tuple(holders),
                    )  # fmt: skip
                return self._create_hold(dir_fd, nbytes, waited)
            finally:
                os.close(lock_fd)  # releases budget.lock, after our hold file is written and locked
        finally:
            os.close(dir_fd)

    def _live_holds(self, dir_fd: int) -> list[NodeHolder]:
        """The hold files of live holders (under budget.lock); stale ones are removed."""
        holders: list[NodeHolder] = []
        for name in sorted(n for n in os.listdir(dir_fd) if n.startswith(_HOLD_PREFIX)):
            try:
                fd = open_file(dir_fd, self.pacing.directory, name, os.O_RDONLY)
            except FileNotFoundError:  # released meanwhile
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # held: a live holder
                    first, pid, label = _read_record(fd)
                    count = int(first) if first.isascii() and first.isdigit() else 0  # written before it was visible
                    holders.append(NodeHolder(pid=pid, nbytes=count, label=label))
                else:  # nobody holds it: its holder died (or released and is about to remove it)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dir_fd)
            finally:
                os.close(fd)
        return holders

    def _create_hold(self, dir_fd: int, nbytes: int, waited: float) -> BudgetHold:
        """Our hold file, created, locked and written (under budget.lock)."""
        p = self.pacing
        name = f"{_HOLD_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        hold = BudgetHold(directory=p.directory, name=name, nbytes=nbytes, waited_seconds=waited)
        try:
            hold._dir_fd = os.dup(dir_fd)  # non-inheritable, like every descriptor Python makes
            try:  # O_EXCL: a new file, ours alone (one link, not a FIFO): nothing to check
                hold._fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | FILE_FLAGS, 0o600, dir_fd=dir_fd)
            except OSError as exc:
                if (error := open_error(p.directory, name, exc, existed=False)) is None:
                    raise
                raise error from None
            hold.live.add(hold)
            fcntl.flock(hold._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else can hold it
            data = hold.record(str(nbytes), self.label)
            if os.pwrite(hold._fd, data, 0) != len(data):
                raise OSError(errno.EIO, f"short write to {name}")
            return hold
        except BaseException:
            hold.release()  # removes the file and closes both descriptors
            raise

    def acquire_slot(
        self, cancelled: Cancelled | None = None, poll: float = DEFAULT_POLL_SECONDS, on_wait: OnWait | None = None
    ) -> SlotHold:
        """A pin slot, waiting on this thread if ``wait``, else :class:`NodeBusyError` at once;
        :class:`NodeWaitCancelled` once ``cancelled()``; ``on_wait(busy)`` once, when the wait begins."""
        return self._wait("slots", self._attempt_slot, cancelled, poll, on_wait)

    def reserve_budget(
        self,
        nbytes: int,
        cancelled: Cancelled | None = None,
        poll: float = DEFAULT_POLL_SECONDS,
        on_wait: OnWait | None = None,
    ) -> BudgetHold:
        """``nbytes`` of the node budget, as :meth:`acquire_slot` waits for a slot."""
        self.check_request(nbytes)
        return self._wait("budget", lambda waited: self._attempt_budget(nbytes, waited), cancelled, poll, on_wait)

    def _next_delay(self, result: object, poll: float, started: float) -> float:
        """After a failed attempt: how long to sleep, or raise when not waiting."""
        if isinstance(result, _Contended):
            if not self.pacing.wait and time.monotonic() - started > _LOCK_GIVE_UP_SECONDS:
                raise NodeBusyError(
                    f"node pacing: {os.path.join(self.pacing.directory, _BUDGET_LOCK)!r} stayed locked for "
                    f"{_LOCK_GIVE_UP_SECONDS:g} s (a rank stopped while admitting?); nothing was pinned. "
                    "Wait with node_wait=True, or find the stopped process (`fuser` on the file)",
                    directory=self.pacing.directory, kind="budget", limit=self.pacing.budget_bytes or 0, in_use=0,
                )  # fmt: skip
            return _LOCK_RETRY_SECONDS
        assert isinstance(result, NodeBusyError)
        if not self.pacing.wait:
            raise result
        return min(poll, max(MIN_POLL_SECONDS, (time.monotonic() - started) * _POLL_FRACTION)) * random.uniform(
            0.8, 1.2
        )

    def _wait(
        self, kind: Kind, attempt: Attempt[H], cancelled: Cancelled | None, poll: float, on_wait: OnWait | None
    ) -> H:
        if isinstance(poll, bool) or not isinstance(poll, int | float) or not 0 < poll <= 60:
            raise ConfigError(f"poll={poll!r} must be a number of seconds in (0, 60]")
        started = time.monotonic()
        report_at = started + self.waiting_first_seconds
        while True:
            result = attempt(time.monotonic() - started)
            if isinstance(result, _Hold):
                return result
            delay = self._next_delay(result, poll, started)
            if on_wait is not None and isinstance(result, NodeBusyError):
                on_wait(result)
                on_wait = None  # once, when the wait begins
            now = time.monotonic()
            if now >= report_at:
                report_at = now + self.waiting_every_seconds
                self._report_waiting(kind, result, now - started)
            if cancelled is not None and cancelled():
                raise NodeWaitCancelled(
                    f"waiting for node pacing in {self.pacing.directory!r} was cancelled after "
                    f"{time.monotonic() - started:.3f} s; nothing is held"
                )
            time.sleep(delay)

    def _report_waiting(self, kind: Kind, result: NodeBusyError | _Contended, waited: float) -> None:
        if (on_waiting := self.on_waiting) is None:
            return
        if isinstance(result, NodeBusyError):
            holders = cast("tuple[NodeHolder, ...]", result.holders)  # _attempt_* build it with NodeHolders
        else:  # budget.lock itself stayed locked: a rank stopped while admitting
            holders = tuple(NodeHolder(pid=pid, label="") for pid in self._budget_lock_pids())
        holders = tuple(replace(h, state=holder_state(h.pid)) for h in holders)
        with contextlib.suppress(Exception):  # a report never changes the wait
            on_waiting(kind, holders, waited)

    def _budget_lock_pids(self) -> tuple[int, ...]:
        try:
            dir_fd = os.open(self.pacing.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return ()
        try:
            return _flock_holders(os.stat(_BUDGET_LOCK, dir_fd=dir_fd, follow_symlinks=False))
        except OSError:
            return ()
        finally:
            os.close(dir_fd)
