"""Node-level pacing: ranks (processes) on one host share pin slots and a byte budget, with no
server. This module owns admission (:class:`NodeAdmission`: one attempt, and the one wait loop);
the rest of node pacing lives in :mod:`pinpool._node.config` (options, environment,
:class:`NodePacing`), :mod:`pinpool._node.directory` (the directory and the trust placed in its
files) and :mod:`pinpool._node.locks` (flock holds, fork safety, what the lock files record).
Its names are re-exported here (``__all__``), so ``pinpool._node.pacing`` is node pacing's one entry point.

Processes cooperate through ``flock(2)``-ed files in one directory (``PINPOOL_NODE_DIR``,
default ``/dev/shm/pinpool-<uid>``); a crashed rank's locks go with it.

**Slots** (``node_slots``, ``PINPOOL_NODE_SLOTS``): at most N processes *pin* at once. The files
``slot-0 .. slot-{N-1}``; a slot is held by ``LOCK_EX`` on one of them (the first that is free)
and released by closing the descriptor. The holder writes its pid and label into the file, for
messages only.

**Budget** (``node_budget``, ``PINPOOL_NODE_BUDGET``): the bytes every cooperating pool holds
pinned, together, stay within a per-host budget. Each holder keeps a file
``hold-<pid>-<random>`` whose content is its byte count and which it holds ``LOCK_EX`` for as
long as it holds the bytes. Admission runs under ``LOCK_EX`` on ``budget.lock``: it lists the
hold files, counts those whose lock is held (a file whose lock can be taken belongs to a dead or
finished holder: it is removed), admits when the sum plus the request fits, and creates the new
hold file, written and locked, before ``budget.lock`` is released. Slot files and
``budget.lock`` are never removed (removing a lock file others may hold open would split the lock
in two); hold files are removed by their holder or, once stale, by the next admission.

Waiting polls (``LOCK_NB`` plus a sleep) on the calling thread: the pool runs it on a thread of
its own and stops it with the ``cancelled()`` callback, checked between attempts, when nothing
is held. The interval starts at 5 ms and grows with the time already waited (5 % of it,
jittered, at most ``poll``, default 0.25 s), so a slot freed after a short pin is taken within
milliseconds while a rank that waits minutes polls a few times a second: the hand-over costs at
most ~5 % of the wait. Waiting is not FIFO. A rank that has waited 10 s, and then every 60 s,
calls ``on_waiting(kind, holders, waited_seconds)`` (the pool logs ``node.waiting``), naming
whom it waits for and whether each holder runs, is stopped (``SIGSTOP``, state ``T`` in
``/proc/<pid>/stat``) or is not found here. Every ``acquire`` closes what it opened on any
``BaseException`` before a hold object exists. The constructor checks the lock files already
there (``lstat``), so a planted file is refused before anything is mapped. Every rank must run
as the same user, and agree on the slot count and the budget.

Containers: ``/dev/shm`` is private to a container by default; ranks in separate containers
cooperate only through a directory they all mount (a hostPath in Kubernetes) named by
``PINPOOL_NODE_DIR``. The pids in file names and messages are in the writer's pid namespace.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar, cast

from .._errors import ConfigError, Kind, NodeBusyError, NodeWaitCancelled
from .._host.files import FILE_FLAGS
from .._units import format_bytes
from .config import (
    BUDGET_ENV,
    DIR_ENV,
    MAX_SLOTS,
    SLOTS_ENV,
    NodePacing,
    default_directory,
    mem_total_bytes,
)
from .directory import _file_error, _file_problem, _open_error, _open_file, open_directory
from .locks import (
    _BUDGET_LOCK,
    _HOLD_PREFIX,
    _LIVE,
    _SLOT_PREFIX,
    BudgetHold,
    NodeHolder,
    SlotHold,
    _flock_holders,
    _Hold,
    _read_record,
    _record,
    holder_state,
)

__all__ = [
    "BUDGET_ENV",
    "DIR_ENV",
    "MAX_SLOTS",
    "SLOTS_ENV",
    "BudgetHold",
    "NodeAdmission",
    "NodeBusyError",
    "NodeHolder",
    "NodePacing",
    "NodeWaitCancelled",
    "SlotHold",
    "default_directory",
    "holder_state",
    "mem_total_bytes",
]

DEFAULT_POLL_SECONDS = 0.25  # the longest interval between two attempts while waiting
MIN_POLL_SECONDS = 0.005  # the first intervals
_POLL_FRACTION = 0.05  # of the time waited so far
# budget.lock is held for a listing and a few tiny reads: a busy one is retried quickly, and a
# fail-fast admission gives up only after this long (a holder stopped with SIGSTOP, say).
_LOCK_RETRY_SECONDS = 0.002
_LOCK_GIVE_UP_SECONDS = 5.0
# A waiting rank says whom it waits for after this long, then again every _WAITING_EVERY_SECONDS.
_WAITING_FIRST_SECONDS = 10.0
_WAITING_EVERY_SECONDS = 60.0

H = TypeVar("H", bound=_Hold)


class _Contended:
    """budget.lock was busy: try again in a moment (not a verdict on the budget)."""


_CONTENDED = _Contended()


OnWaiting = Callable[[Kind, tuple[NodeHolder, ...], float], object]


class NodeAdmission:
    """Admission to a node's pin slots and byte budget, for one pool (``label``: its name).

    The constructor creates and checks the directory, and the lock files already in it
    (:class:`ConfigError` at once, before anything is mapped); every acquisition checks them
    again. Holds from a NodeAdmission of no slots (or no budget) are free and released already:
    callers need no special case.

    ``on_waiting(kind, holders, waited_seconds)``, if given, is called from the waiting thread
    when a wait has lasted 10 s, then every 60 s: ``kind`` is ``"slots"`` or ``"budget"``,
    ``holders`` whom it waits for, each with its :attr:`NodeHolder.state` looked up
    (``"stopped"``: a holder stopped with SIGSTOP holds its share until continued or killed).
    A pool passes its observer's ``node_waiting``, which logs ``node.waiting``. An
    ``Exception`` it raises is ignored: a report never changes the wait.
    """

    def __init__(self, pacing: NodePacing, *, label: str = "", on_waiting: OnWaiting | None = None) -> None:
        if not isinstance(pacing, NodePacing):
            raise ConfigError(f"pacing={pacing!r} must be a NodePacing")
        if on_waiting is not None and not callable(on_waiting):
            raise ConfigError(f"on_waiting={on_waiting!r} must be callable(kind, holders, waited_seconds)")
        self.pacing = pacing
        self.label = label
        self.on_waiting = on_waiting
        dir_fd = open_directory(pacing.directory)
        try:
            self._check_present(dir_fd)
        finally:
            os.close(dir_fd)

    def _check_present(self, dir_fd: int) -> None:
        """:class:`ConfigError` for a lock file of this pacing that is there and unusable (``lstat``:
        nothing is opened). Acquisition checks each file it opens again, with ``fstat``."""
        p = self.pacing
        for name in os.listdir(dir_fd):
            if name.startswith(_SLOT_PREFIX):
                index = name[len(_SLOT_PREFIX) :]
                if p.slots is None or not (index.isascii() and index.isdigit() and int(index) < p.slots):
                    continue
            elif not (p.budget_bytes is not None and (name == _BUDGET_LOCK or name.startswith(_HOLD_PREFIX))):
                continue
            try:
                problem = _file_problem(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
            except FileNotFoundError:  # a hold file released meanwhile
                continue
            if problem is not None:
                raise _file_error(p.directory, name, problem)

    def __repr__(self) -> str:
        p = self.pacing
        budget = None if p.budget_bytes is None else format_bytes(p.budget_bytes)
        return f"<NodeAdmission {p.directory!r} slots={p.slots} budget={budget} wait={p.wait}>"

    # -- one attempt -----------------------------------------------------------------------------

    def try_acquire_slot(self) -> SlotHold | NodeBusyError:
        """One attempt: a slot, or the :class:`NodeBusyError` that says who holds them all (not raised)."""
        return self._attempt_slot(0.0)

    def try_reserve_budget(self, nbytes: int) -> BudgetHold | NodeBusyError | None:
        """One attempt: the bytes, the :class:`NodeBusyError` that says who holds the budget (not
        raised), or None when another rank was admitting at this instant (try again)."""
        self.check_request(nbytes)
        result = self._attempt_budget(nbytes, 0.0)
        return None if isinstance(result, _Contended) else result

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
                    hold._fd = _open_file(dir_fd, p.directory, f"{_SLOT_PREFIX}{index}", os.O_RDWR | os.O_CREAT)
                    _LIVE.add(hold)
                    try:
                        fcntl.flock(hold._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        _first, pid, label = _read_record(hold._fd)
                        holders.append(NodeHolder(pid=pid, label=label))
                        hold.release()  # closes a descriptor that holds no lock
                        continue
                    try:  # ours: say who holds it (for others' messages only; a failed write changes nothing)
                        os.ftruncate(hold._fd, 0)
                        os.pwrite(hold._fd, _record(os.getpid(), "slot", self.label), 0)
                    except OSError:
                        pass
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
        """:class:`ConfigError` unless ``nbytes`` is a positive int that fits the whole budget (call it
        at construction: a pool larger than the budget could never be admitted)."""
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
            lock_fd = _open_file(dir_fd, p.directory, _BUDGET_LOCK, os.O_RDWR | os.O_CREAT)
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
        directory = self.pacing.directory
        holders: list[NodeHolder] = []
        for name in sorted(os.listdir(dir_fd)):
            if not name.startswith(_HOLD_PREFIX):
                continue
            try:
                fd = _open_file(dir_fd, directory, name, os.O_RDONLY)
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
                    try:
                        os.unlink(name, dir_fd=dir_fd)
                    except FileNotFoundError:
                        pass
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
                error = _open_error(p.directory, name, exc, existed=False)
                if error is None:
                    raise
                raise error from None
            _LIVE.add(hold)
            fcntl.flock(hold._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else can hold it
            data = _record(os.getpid(), str(nbytes), self.label)
            if os.pwrite(hold._fd, data, 0) != len(data):
                raise OSError(errno.EIO, f"short write to {name}")
            return hold
        except BaseException:
            hold.release()  # removes the file and closes both descriptors
            raise

    # -- waiting ---------------------------------------------------------------------------------

    def acquire_slot_sync(
        self,
        cancelled: Callable[[], bool] | None = None,
        poll: float = DEFAULT_POLL_SECONDS,
        on_wait: Callable[[NodeBusyError], object] | None = None,
    ) -> SlotHold:
        """A pin slot, waiting on this thread if ``wait`` (polling at most ``poll`` s apart, see the module doc).

        Raises :class:`NodeBusyError` at once without ``wait``; :class:`NodeWaitCancelled` when
        ``cancelled()`` returns True (checked before every sleep). ``on_wait(busy)`` is called once,
        when the first attempt finds every slot taken and the call is going to wait.
        """
        return self._wait("slots", lambda waited: self._attempt_slot(waited), cancelled, poll, on_wait)

    def reserve_budget_sync(
        self,
        nbytes: int,
        cancelled: Callable[[], bool] | None = None,
        poll: float = DEFAULT_POLL_SECONDS,
        on_wait: Callable[[NodeBusyError], object] | None = None,
    ) -> BudgetHold:
        """``nbytes`` of the node budget, as :meth:`acquire_slot_sync` waits for a slot.
        :class:`ConfigError` at once when ``nbytes`` exceeds the whole budget."""
        self.check_request(nbytes)
        return self._wait("budget", lambda waited: self._attempt_budget(nbytes, waited), cancelled, poll, on_wait)

    def _next_delay(self, result: object, poll: float, started: float) -> float:
        """After a failed attempt: how long to sleep (see the module doc), or raise when not waiting."""
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
        waited = time.monotonic() - started
        return min(poll, max(MIN_POLL_SECONDS, waited * _POLL_FRACTION)) * random.uniform(0.8, 1.2)

    def _wait(
        self,
        kind: Kind,
        attempt: Callable[[float], H | NodeBusyError | _Contended],
        cancelled: Callable[[], bool] | None,
        poll: float,
        on_wait: Callable[[NodeBusyError], object] | None,
    ) -> H:
        _check_poll(poll)
        started = time.monotonic()
        report_at = started + _WAITING_FIRST_SECONDS
        told = False
        while True:
            result = attempt(time.monotonic() - started)
            if isinstance(result, _Hold):
                return result
            delay = self._next_delay(result, poll, started)
            if isinstance(result, NodeBusyError) and not told:
                told = True
                if on_wait is not None:
                    on_wait(result)
            now = time.monotonic()
            if now >= report_at:
                report_at = now + _WAITING_EVERY_SECONDS
                self._report_waiting(kind, result, now - started)
            if cancelled is not None and cancelled():
                raise NodeWaitCancelled(
                    f"waiting for node pacing in {self.pacing.directory!r} was cancelled after "
                    f"{time.monotonic() - started:.3f} s; nothing is held"
                )
            time.sleep(delay)

    def _report_waiting(self, kind: Kind, result: NodeBusyError | _Contended, waited: float) -> None:
        """``on_waiting`` with whom this rank waits for and their states (a few reads of /proc)."""
        on_waiting = self.on_waiting
        if on_waiting is None:
            return
        if isinstance(result, NodeBusyError):
            holders = cast("tuple[NodeHolder, ...]", result.holders)  # _admit raises it with NodeHolders
        else:  # budget.lock itself stayed locked: a rank stopped while admitting
            holders = tuple(NodeHolder(pid=pid, label="") for pid in self._budget_lock_pids())
        holders = tuple(replace(h, state=holder_state(h.pid)) for h in holders)
        try:
            on_waiting(kind, holders, waited)
        except Exception:  # a report never changes the wait
            pass

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


def _check_poll(poll: float) -> None:
    if isinstance(poll, bool) or not isinstance(poll, int | float) or not 0 < poll <= 60:
        raise ConfigError(f"poll={poll!r} must be a number of seconds in (0, 60]")
