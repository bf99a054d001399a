"""Node-level pacing: ranks (processes) on one host share pin slots and a byte budget, with no server.

Processes cooperate through ``flock(2)``-ed files in one directory (``PINPOOL_NODE_DIR``,
default ``/dev/shm/pinpool-<uid>``). A flock belongs to an open file description and the
kernel drops it when the last descriptor to that description is closed, which includes the
holder's death by SIGKILL: nothing a crashed rank held stays held.

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
``BaseException`` before a hold object exists; a hold releases once (``release()`` is
idempotent) and is a context manager.

**Fork**: descriptors are opened ``O_CLOEXEC``, so an ``exec``'d child gets none. A child forked
without ``exec`` inherits them, and with them the parent's open file descriptions, which would
keep the parent's slot locked after the parent releases it, for as long as the child lives. So,
in a forked child, every hold inherited from the parent is forgotten at fork
(``os.register_at_fork``): the child closes its copies of the descriptors, which never releases
the lock (the parent's descriptor still refers to the description), and marks the hold as
released; ``release()`` of a hold in any process but the one that acquired it does nothing, and
never removes the parent's hold file.

**Trust**: the directory is created with mode 0700 when missing; an existing one must be a real
directory (not a symlink), owned by this process's effective uid, not group- or
world-writable, and writable and searchable by this process, else :class:`ConfigError` says
what is wrong and how to fix it. It is opened ``O_DIRECTORY | O_NOFOLLOW`` and every file is
opened relative to that descriptor with ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC`` (mode 0600,
never ``O_TRUNC``): a FIFO, socket or device planted under a lock file's name is seen by
``lstat`` before the open and by ``fstat`` after it, and the open never waits for a writer.
Before a byte is read, written or truncated, or a lock taken, ``fstat`` must show a regular
file with one link (a hard link in place of a slot file would make pinpool overwrite the file
it names), owned by us and not group- or world-writable; anything else is a
:class:`ConfigError` naming the file and telling to remove it. ``O_NONBLOCK`` stays set: it
changes nothing for a regular file, the only kind used. The constructor checks the files
already there the same way (``lstat``), so a planted file is refused before anything is
mapped. pinpool never changes the mode of a directory it did not create. Every rank must
therefore run as the same user, and agree on the slot count and the budget.

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
import stat
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from types import TracebackType
from typing import Literal, TypeVar

from ._errors import ConfigError, PinpoolError
from ._units import ascii_decimal, decimal_to_int, format_bytes, parse_size, shown

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

SLOTS_ENV = "PINPOOL_NODE_SLOTS"
BUDGET_ENV = "PINPOOL_NODE_BUDGET"
DIR_ENV = "PINPOOL_NODE_DIR"

MAX_SLOTS = 1024  # a waiting rank opens every slot file once per poll
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

_SLOT_PREFIX = "slot-"
_HOLD_PREFIX = "hold-"
_BUDGET_LOCK = "budget.lock"
# O_NONBLOCK: opening a FIFO never waits for its other end (regular files ignore the flag).
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_RECORD_LIMIT = 512  # bytes read back from a slot or hold file

Kind = Literal["slots", "budget"]
H = TypeVar("H", bound="_Hold")


# -- errors ----------------------------------------------------------------------------------------


HolderState = Literal["running", "stopped", "zombie", "not found", "unknown"]


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


class NodeBusyError(PinpoolError, RuntimeError):
    """Node pacing with ``node_wait=False``: every slot is taken, or the request does not fit the
    node's byte budget now. Nothing was pinned and nothing is held.

    Not a :class:`ConfigError`: the input is fine, the node is busy. ``kind`` is ``"slots"`` or
    ``"budget"``; ``limit`` the slot count or budget in bytes; ``requested`` the bytes asked for
    (budget) or None; ``in_use`` the slots taken or bytes held; ``holders`` who holds them.
    """

    def __init__(
        self,
        message: str,
        *,
        directory: str,
        kind: Kind,
        limit: int,
        in_use: int,
        requested: int | None = None,
        holders: tuple[NodeHolder, ...] = (),
    ) -> None:
        self.directory = directory
        self.kind = kind
        self.limit = limit
        self.in_use = in_use
        self.requested = requested
        self.holders = holders
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (_restore_error, (type(self), self.args), self.__dict__)


class NodeWaitCancelled(PinpoolError):
    """A synchronous admission wait was given up because its ``cancelled()`` callback returned True.
    Nothing is held."""


def _restore_error(cls: type[BaseException], args: tuple[object, ...]) -> BaseException:
    return cls.__new__(cls, *args)


# -- configuration ---------------------------------------------------------------------------------


def mem_total_bytes(meminfo: str = "/proc/meminfo") -> int:
    """``MemTotal`` of /proc/meminfo in bytes (the host's, also inside a container)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    raise ConfigError(
        f"node_budget as a fraction of MemTotal needs {meminfo}, which has no readable MemTotal; "
        "give the budget in bytes instead (e.g. node_budget='512GiB')"
    )


def default_directory(uid: int | None = None) -> str:
    """``/dev/shm/pinpool-<uid>`` (tmpfs, per host), else ``/run/user/<uid>/pinpool``, else
    ``/tmp/pinpool-<uid>``. Not ``$TMPDIR``: ranks with different TMPDIRs would not see each other."""
    uid = os.geteuid() if uid is None else uid
    if os.path.isdir("/dev/shm"):
        return f"/dev/shm/pinpool-{uid}"
    run = f"/run/user/{uid}"
    if os.path.isdir(run):
        return os.path.join(run, "pinpool")
    return f"/tmp/pinpool-{uid}" if os.path.isdir("/tmp") else f"/var/tmp/pinpool-{uid}"


_SLOTS_FIX = f"give a whole number of processes that may pin at once, 1 to {MAX_SLOTS} (e.g. 2)"
_BUDGET_HINT = (
    'bytes (an int, or a size such as "512GiB"), a fraction of MemTotal (a float in (0, 1] such as 0.8, '
    'or the strings "0.8" or "80%")'
)


def _parse_slots(value: object, *, what: str, from_env: bool = False) -> int:
    if from_env and isinstance(value, str):  # strict ASCII digits
        if not (value.isascii() and value.isdigit()):
            raise ConfigError(f"{what}={shown(value)} is not a positive integer; {_SLOTS_FIX}, or unset {SLOTS_ENV}")
        number = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        raise ConfigError(f"{what}={shown(value)} has type {type(value).__name__}; {_SLOTS_FIX}")
    if not 1 <= number <= MAX_SLOTS:
        raise ConfigError(f"{what}={shown(value)} is out of range; {_SLOTS_FIX}")
    return number


def _fraction_bytes(fraction: Decimal, given: object, what: str, mem_total: int | None) -> int:
    if not fraction.is_finite() or not 0 < fraction <= 1:
        raise ConfigError(f"{what}={given!r}: a fraction of MemTotal must be in (0, 1]; give {_BUDGET_HINT}")
    total = mem_total_bytes() if mem_total is None else mem_total
    nbytes = decimal_to_int(fraction, total)
    if not nbytes:
        raise ConfigError(f"{what}={given!r} of MemTotal ({total} B) is less than one byte; give {_BUDGET_HINT}")
    return nbytes


def _parse_budget(value: object, *, what: str, mem_total: int | None) -> int:
    """Bytes from an int, a size string, a float fraction, ``"0.8"`` or ``"80%"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}={value!r} is a bool; give {_BUDGET_HINT}")
    if isinstance(value, float):
        return _fraction_bytes(Decimal(repr(value)), value, what, mem_total)
    if isinstance(value, str):
        # ASCII only, like every pinpool number: "١٠%", "８０%" or a non-breaking space are errors.
        text = value.strip(" \t\n")
        fix = f"give {_BUDGET_HINT}"
        if text.endswith("%"):
            percent = ascii_decimal(text[:-1], what=what, fix=fix, given=value)
            return _fraction_bytes(percent / 100, value, what, mem_total)
        if text and "." in text and not any(c.isalpha() for c in text):  # a unitless decimal: a fraction
            number = ascii_decimal(text, what=what, fix=fix, given=value)
            if number > 1:
                raise ConfigError(
                    f"{what}={value!r}: a unitless decimal is a fraction of MemTotal and must be in (0, 1]; "
                    f"for bytes give an integer or a size with a unit; give {_BUDGET_HINT}"
                )
            return _fraction_bytes(number, value, what, mem_total)
    if isinstance(value, int | str):
        try:
            return parse_size(value, what=what)
        except ConfigError as exc:
            raise ConfigError(f"{exc}; the budget may also be {_BUDGET_HINT}") from None
    raise ConfigError(f"{what}={value!r} has type {type(value).__name__}; give {_BUDGET_HINT}")


@dataclass(frozen=True)
class NodePacing:
    """How the pools of one host pace each other (see the module doc).

    directory: an absolute path, shared by every cooperating rank. slots: how many processes may
    pin at once (None: unlimited). budget_bytes: the bytes all cooperating pools may hold pinned
    together (None: no budget). wait: True, admission waits; False, it raises
    :class:`NodeBusyError` at once. At least one of ``slots`` and ``budget_bytes`` is set; "no
    pacing" is ``None``, which :meth:`from_options` returns when neither is asked for.
    """

    directory: str
    slots: int | None = None
    budget_bytes: int | None = None
    wait: bool = True

    def __post_init__(self) -> None:
        d = self.directory
        if not isinstance(d, str) or not d or not os.path.isabs(d) or "\0" in d:
            raise ConfigError(
                f"node_dir={d!r} must be an absolute path (every rank must name the same directory, whatever "
                f"its working directory); set node_dir= or {DIR_ENV} to e.g. {default_directory()!r}"
            )
        object.__setattr__(self, "directory", os.path.normpath(d))
        if self.slots is not None:
            _parse_slots(self.slots, what="node_slots")
        if self.budget_bytes is not None:
            b = self.budget_bytes
            if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
                raise ConfigError(
                    f"budget_bytes={b!r} must be a positive int; use NodePacing.from_options for sizes and fractions"
                )
        if self.slots is None and self.budget_bytes is None:
            raise ConfigError("NodePacing needs slots or budget_bytes (no pacing is None, not an empty NodePacing)")
        if not isinstance(self.wait, bool):
            raise ConfigError(f"node_wait={self.wait!r} must be True (wait for admission) or False (fail fast)")

    @classmethod
    def from_options(
        cls,
        *,
        node_slots: int | None = None,
        node_budget: int | float | str | None = None,
        node_dir: str | os.PathLike[str] | None = None,
        node_wait: bool = True,
        environ: Mapping[str, str] | None = None,
        mem_total: int | None = None,
    ) -> NodePacing | None:
        """Pacing from a pool's options, each falling back to its environment variable
        (``PINPOOL_NODE_SLOTS``, ``PINPOOL_NODE_BUDGET``, ``PINPOOL_NODE_DIR``; an argument wins).
        None when neither slots nor a budget is asked for. No file is touched here.

        ``mem_total`` (bytes) replaces /proc/meminfo's MemTotal for fractional budgets (tests).
        """
        env = os.environ if environ is None else environ
        if node_slots is not None:
            slots: int | None = _parse_slots(node_slots, what="node_slots")
        elif (raw := env.get(SLOTS_ENV)) is not None:
            slots = _parse_slots(raw, what=SLOTS_ENV, from_env=True)
        else:
            slots = None
        if node_budget is not None:
            budget: int | None = _parse_budget(node_budget, what="node_budget", mem_total=mem_total)
        elif (raw := env.get(BUDGET_ENV)) is not None:
            budget = _parse_budget(raw, what=BUDGET_ENV, mem_total=mem_total)
        else:
            budget = None
        if not isinstance(node_wait, bool):
            raise ConfigError(f"node_wait={node_wait!r} must be True (wait for admission) or False (fail fast)")
        if node_dir is not None:
            try:
                directory = os.fspath(node_dir)
            except TypeError:
                raise ConfigError(f"node_dir={node_dir!r} must be a path (str or os.PathLike)") from None
            what = "node_dir"
        elif (raw := env.get(DIR_ENV)) is not None:
            directory, what = raw, DIR_ENV
        else:
            directory, what = default_directory(), "the default node_dir"
        if not isinstance(directory, str) or not directory or not os.path.isabs(directory) or "\0" in directory:
            raise ConfigError(
                f"{what}={directory!r} must be an absolute path (every rank must name the same directory); "
                f"set node_dir= or {DIR_ENV} to e.g. {default_directory()!r}"
            )
        if slots is None and budget is None:
            return None
        return cls(directory=directory, slots=slots, budget_bytes=budget, wait=node_wait)


# -- the directory and its files -------------------------------------------------------------------


def _problem(st: os.stat_result) -> str | None:
    """What makes a directory or file we found untrustworthy, or None."""
    euid = os.geteuid()
    if st.st_uid != euid:
        return f"is owned by uid {st.st_uid}, not by this process's uid {euid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is group- or world-writable (mode {stat.S_IMODE(st.st_mode):#o})"
    return None


_FILE_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def _file_problem(st: os.stat_result) -> str | None:
    """What makes a lock file (``lstat`` or ``fstat``) unusable, or None: pinpool reads, writes,
    truncates and locks only a regular file of ours with one link."""
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return "is a symbolic link (pinpool never follows links to its lock files)"
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), f"file type {stat.S_IFMT(mode):#o}")
        return f"is not a regular file ({kind})"
    if st.st_nlink > 1:
        return (
            f"has {st.st_nlink} hard links (another name refers to the same file, and pinpool writes "
            "into its lock files)"
        )
    return _problem(st)


def _file_error(directory: str, name: str, problem: str) -> ConfigError:
    return ConfigError(
        f"node pacing file {os.path.join(directory, name)!r} {problem}; remove it (pinpool recreates it "
        "with mode 0600), and make sure only this user can write the directory"
    )


def _unwritable(directory: str, code: int, doing: str = "") -> ConfigError:
    """The directory refused a file (EACCES, EPERM, EROFS): the errno, and what to do."""
    reason = f"{errno.errorcode.get(code, f'E{code}')}: {os.strerror(code)}"
    if code == errno.EROFS:
        fix = f"set node_dir= / {DIR_ENV} to a directory on a writable file system (such as {default_directory()!r})"
    else:
        fix = (
            f"give this user write and search permission on it (`chmod u+rwx {directory}`), or set node_dir= / "
            f"{DIR_ENV} to a directory this user owns and can write"
        )
    return ConfigError(
        f"node pacing directory {directory!r} is not writable by this process ({reason}){doing}: every rank "
        f"creates and writes its lock files there; {fix}"
    )


def _check_writable(fd: int, path: str) -> None:
    """:class:`ConfigError` unless this process may create files in the directory ``fd``."""
    if os.access(".", os.W_OK | os.X_OK, dir_fd=fd, effective_ids=True):
        return
    try:
        read_only = bool(os.fstatvfs(fd).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    raise _unwritable(path, errno.EROFS if read_only else errno.EACCES)


def open_directory(path: str) -> int:
    """Create ``path`` (mode 0700) if missing, check it, and return an ``O_DIRECTORY | O_NOFOLLOW``
    descriptor to it; :class:`ConfigError` naming the path, the problem and the fix otherwise."""
    fix_env = f"or set node_dir= / {DIR_ENV} to a directory this user owns"
    created = False
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise ConfigError(
            f"node pacing directory {path!r}: its parent {os.path.dirname(path)!r} does not exist; "
            f"create the parent (pinpool creates only the last component), {fix_env}"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"node pacing directory {path!r} cannot be created: {exc.strerror or exc}; {fix_env}"
        ) from None
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigError(
            f"node pacing directory {path!r} cannot be inspected: {exc.strerror or exc}; {fix_env}"
        ) from None
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(
            f"node pacing directory {path!r} is a symbolic link; pinpool never follows links to its lock files. "
            f"Remove the link, {fix_env}"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"node pacing directory {path!r} exists but is not a directory; remove it, {fix_env}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(
            f"node pacing directory {path!r} cannot be opened: {exc.strerror or exc}; {fix_env}"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):  # replaced between lstat and open
            raise ConfigError(f"node pacing directory {path!r} is not a directory; {fix_env}")
        if st.st_uid == os.geteuid() and created:
            os.fchmod(fd, 0o700)  # ours, just made: undo what a umask took away; never anyone else's
            st = os.fstat(fd)
        problem = _problem(st)
        if problem is not None:
            fix = (
                f"run `chmod go-w {path}` (pinpool never changes a directory it did not create)"
                if st.st_uid == os.geteuid()
                else "lock files in a directory another user controls cannot be trusted: remove it, run every "
                "rank as that user"
            )
            raise ConfigError(f"node pacing directory {path!r} {problem}; {fix}, {fix_env}")
        _check_writable(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_error(directory: str, name: str, exc: OSError, *, existed: bool) -> ConfigError | None:
    """The :class:`ConfigError` for an ``open`` of a lock file that failed, or None (raise ``exc``)."""
    code = exc.errno
    if code == errno.ELOOP:
        return _file_error(directory, name, "is a symbolic link (pinpool never follows links to its lock files)")
    if code in (errno.EISDIR, errno.ENXIO):  # a directory; a socket, or a device with nothing behind it
        return _file_error(directory, name, "is not a regular file")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        if code == errno.EROFS or not existed:
            return _unwritable(directory, code, f" (creating {name!r})")
        reason = f"{errno.errorcode.get(code, f'E{code}')}: {os.strerror(code)}"
        return _file_error(directory, name, f"cannot be opened ({reason})")
    return None


def _open_file(dir_fd: int, directory: str, name: str, flags: int) -> int:
    """Open ``name`` in the directory (O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, mode 0600 if created)
    and check it: a regular file of ours with one link, else :class:`ConfigError`. ``lstat``
    first, so a FIFO or a device is refused without being opened; ``fstat`` after, for a file
    swapped in between. :class:`FileNotFoundError` when the file is missing or was removed
    meanwhile, unless ``flags`` has O_CREAT."""
    for _attempt in range(8):
        try:
            problem = _file_problem(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
            existed = True
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
            problem, existed = None, False
        if problem is not None:
            raise _file_error(directory, name, problem)
        try:
            fd = os.open(name, flags | _FILE_FLAGS, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            error = _open_error(directory, name, exc, existed=existed)
            if error is None:
                raise
            raise error from None
        try:
            st = os.fstat(fd)
            gone = st.st_nlink == 0
            problem = None if gone else _file_problem(st)
            if problem is not None:
                raise _file_error(directory, name, problem)
        except BaseException:
            os.close(fd)
            raise
        if not gone:
            return fd
        os.close(fd)  # removed between the open and the fstat
        if not flags & os.O_CREAT:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)
    raise ConfigError(
        f"node pacing file {os.path.join(directory, name)!r} was removed each time it was opened; something "
        "is deleting pinpool's lock files: stop it"
    )


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


# -- admission -------------------------------------------------------------------------------------


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
                hold._fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, 0o600, dir_fd=dir_fd)
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
            holders = result.holders
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
