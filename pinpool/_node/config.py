"""Node pacing's configuration (``node_slots``, ``node_budget``, ``node_dir``, else their environment variables:
docs/serving.md) and the directory it trusts: made 0700, else ours and not group- or world-writable; its lock
files are checked before and after each open to be regular files of ours with one link."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal

from .._errors import ConfigError
from .._host.files import FILE_FLAGS, owner_problem, regular_file_problem
from .._units import ascii_decimal, decimal_to_int, parse_size, shown

SLOTS_ENV = "PINPOOL_NODE_SLOTS"
BUDGET_ENV = "PINPOOL_NODE_BUDGET"
DIR_ENV = "PINPOOL_NODE_DIR"

MAX_SLOTS = 1024  # a waiting rank opens every slot file once per poll


def mem_total_bytes(meminfo: str = "/proc/meminfo") -> int:
    """``MemTotal`` of /proc/meminfo in bytes (the host's, also inside a container)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(meminfo) as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise ConfigError(
        f"node_budget as a fraction of MemTotal needs {meminfo}, which has no readable MemTotal; "
        "give the budget in bytes instead (e.g. node_budget='512GiB')"
    )


def default_directory(uid: int | None = None) -> str:
    """``/dev/shm/pinpool-<uid>``, else ``/run/user/<uid>/pinpool``, else under /tmp; never ``$TMPDIR`` (per rank)."""
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


def _in_range(fraction: Decimal, given: object, what: str, of: str, hint: str) -> Decimal:
    if not fraction.is_finite() or not 0 < fraction <= 1:
        raise ConfigError(f"{what}={given!r}: a fraction of {of} must be in (0, 1]; give {hint}")
    return fraction


def parse_fraction(value: object, *, what: str, of: str, hint: str) -> Decimal | None:
    """A fraction in (0, 1] from a float (``0.8``) or a string (``"0.8"``, ``"80%"``; ASCII only),
    None for a value not spelled as one (an int, ``"512GiB"``). ``of``, ``hint``: for messages."""
    if isinstance(value, float):
        return _in_range(Decimal(repr(value)), value, what, of, hint)
    if not isinstance(value, str):
        return None
    text = value.strip(" \t\n")
    if text.endswith("%"):
        percent = ascii_decimal(text[:-1], what=what, fix=f"give {hint}", given=value)
        return _in_range(percent / 100, value, what, of, hint)
    if text and "." in text and not any(c.isalpha() for c in text):  # a unitless decimal: a fraction
        number = ascii_decimal(text, what=what, fix=f"give {hint}", given=value)
        if number > 1:
            raise ConfigError(
                f"{what}={value!r}: a unitless decimal is a fraction of {of} and must be in (0, 1]; "
                f"for bytes give an integer or a size with a unit; give {hint}"
            )
        return _in_range(number, value, what, of, hint)
    return None


def _parse_budget(value: object, *, what: str, mem_total: int | None) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{what}={value!r} is a bool; give {_BUDGET_HINT}")
    fraction = parse_fraction(value, what=what, of="MemTotal", hint=_BUDGET_HINT)
    if fraction is not None:
        total = mem_total_bytes() if mem_total is None else mem_total
        nbytes = decimal_to_int(fraction, total)
        if not nbytes:
            raise ConfigError(f"{what}={value!r} of MemTotal ({total} B) is less than one byte; give {_BUDGET_HINT}")
        return nbytes
    if isinstance(value, int | str):
        try:
            return parse_size(value, what=what)
        except ConfigError as exc:
            raise ConfigError(f"{exc}; the budget may also be {_BUDGET_HINT}") from None
    raise ConfigError(f"{what}={value!r} has type {type(value).__name__}; give {_BUDGET_HINT}")


@dataclass(frozen=True)
class NodePacing:
    """How the pools of one host pace each other: ``slots`` and/or ``budget_bytes`` (None: not paced;
    no pacing at all is None), in ``directory``; ``wait=False`` raises NodeBusyError at once."""

    directory: str
    slots: int | None = None
    budget_bytes: int | None = None
    wait: bool = True

    def __post_init__(self) -> None:
        _check_directory(self.directory, "node_dir")
        object.__setattr__(self, "directory", os.path.normpath(self.directory))
        if self.slots is not None:
            _parse_slots(self.slots, what="node_slots")
        b = self.budget_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
            raise ConfigError(f"budget_bytes={b!r} must be a positive int (from_options reads sizes and fractions)")
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
        """Pacing from a pool's options or their environment variables; None without slots or a budget."""
        env = os.environ if environ is None else environ
        if node_slots is not None:
            slots: int | None = _parse_slots(node_slots, what="node_slots")
        else:
            raw = env.get(SLOTS_ENV)
            slots = None if raw is None else _parse_slots(raw, what=SLOTS_ENV, from_env=True)
        if node_budget is not None:
            budget: int | None = _parse_budget(node_budget, what="node_budget", mem_total=mem_total)
        else:
            raw = env.get(BUDGET_ENV)
            budget = None if raw is None else _parse_budget(raw, what=BUDGET_ENV, mem_total=mem_total)
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
        _check_directory(directory, what)
        paced = slots is not None or budget is not None
        return cls(directory=directory, slots=slots, budget_bytes=budget, wait=node_wait) if paced else None


def _check_directory(directory: object, what: str) -> None:
    if not isinstance(directory, str) or not directory or not os.path.isabs(directory) or "\0" in directory:
        raise ConfigError(
            f"{what}={directory!r} must be an absolute path (every rank must name the same directory, whatever "
            f"its working directory); set node_dir= or {DIR_ENV} to e.g. {default_directory()!r}"
        )


# -- the directory and its files --------------------------------------------------------------------


def file_problem(st: os.stat_result) -> str | None:
    linked = "another name refers to the same file, and pinpool writes into its lock files"
    return regular_file_problem(st, files="its lock files", linked=linked)


def file_error(directory: str, name: str, problem: str) -> ConfigError:
    return ConfigError(
        f"node pacing file {os.path.join(directory, name)!r} {problem}; remove it (pinpool recreates it "
        "with mode 0600), and make sure only this user can write the directory"
    )


def _reason(code: int) -> str:
    return f"{errno.errorcode.get(code, f'E{code}')}: {os.strerror(code)}"


# What creating a file says where none can be made (/proc, /sys: root passes the permission checks), or no room.
_CANNOT_CREATE = (errno.ENOENT, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSPC, errno.EDQUOT)


def _unwritable(directory: str, code: int, creating: str | None = None) -> ConfigError:
    """``creating``: what the file system refused after the permission checks passed (read-only, full, /proc)."""
    if creating is None and code != errno.EROFS:
        fix = (
            f"give this user write and search permission on it (`chmod u+rwx {directory}`), or set node_dir= / "
            f"{DIR_ENV} to a directory this user owns and can write"
        )
    else:
        fix = f"set node_dir= / {DIR_ENV} to a directory on a writable file system (such as {default_directory()!r})"
    doing = "" if creating is None else f" (creating {creating})"
    return ConfigError(
        f"node pacing directory {directory!r} is not writable by this process ({_reason(code)}){doing}: every rank "
        f"creates and writes its lock files there; {fix}"
    )


def _check_writable(fd: int, path: str) -> None:
    if os.access(".", os.W_OK | os.X_OK, dir_fd=fd, effective_ids=True):
        return
    try:
        read_only = bool(os.fstatvfs(fd).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    raise _unwritable(path, errno.EROFS if read_only else errno.EACCES)


def open_directory(path: str, *, probe: bool = False) -> int:
    """Create ``path`` 0700 if missing, check it (``probe``: by making a file in it), return a descriptor of it."""
    fix_env = f"or set node_dir= / {DIR_ENV} to a directory this user owns"

    def failed(doing: str, exc: OSError) -> ConfigError:
        return ConfigError(f"node pacing directory {path!r} {doing}: {exc.strerror or exc}; {fix_env}")

    created = False
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        pass
    except FileNotFoundError as exc:
        if os.path.isdir(os.path.dirname(path)):  # a file system that makes no directories (/proc)
            raise failed("cannot be created", exc) from None
        raise ConfigError(
            f"node pacing directory {path!r}: its parent {os.path.dirname(path)!r} does not exist; "
            f"create the parent (pinpool creates only the last component), {fix_env}"
        ) from None
    except OSError as exc:
        raise failed("cannot be created", exc) from None
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise failed("cannot be inspected", exc) from None
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
        raise failed("cannot be opened", exc) from None
    try:
        st = os.fstat(fd)  # a directory: O_DIRECTORY
        if st.st_uid == os.geteuid() and created:
            os.fchmod(fd, 0o700)  # ours, just made: undo what a umask took away; never anyone else's
            st = os.fstat(fd)
        problem = owner_problem(st)
        if problem is not None:
            fix = (
                f"run `chmod go-w {path}` (pinpool never changes a directory it did not create)"
                if st.st_uid == os.geteuid()
                else "lock files in a directory another user controls cannot be trusted: remove it, run every "
                "rank as that user"
            )
            raise ConfigError(f"node pacing directory {path!r} {problem}; {fix}, {fix_env}")
        _check_writable(fd, path)
        if probe:
            _check_creates(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_creates(dir_fd: int, directory: str) -> None:
    """A file made and removed: a directory that holds none (/proc, /sys: root passes the checks) fails now."""
    name = f".probe-{os.getpid()}-{secrets.token_hex(8)}"  # never a lock file's name
    try:
        os.close(os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | FILE_FLAGS, 0o600, dir_fd=dir_fd))
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, *_CANNOT_CREATE):
            raise
        raise _unwritable(directory, exc.errno, "a file") from None
    os.unlink(name, dir_fd=dir_fd)


def open_error(directory: str, name: str, exc: OSError, *, existed: bool) -> ConfigError | None:
    """The :class:`ConfigError` for an ``open`` of a lock file that failed, or None (raise ``exc``)."""
    code = exc.errno
    if code == errno.ELOOP:
        return file_error(directory, name, "is a symbolic link (pinpool never follows links to its lock files)")
    if code in (errno.EISDIR, errno.ENXIO):  # a directory; a socket, or a device with nothing behind it
        return file_error(directory, name, "is not a regular file")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        if code == errno.EROFS or not existed:
            return _unwritable(directory, code, repr(name))
        return file_error(directory, name, f"cannot be opened ({_reason(code)})")
    return _unwritable(directory, code, repr(name)) if code in _CANNOT_CREATE and not existed else None


def open_file(dir_fd: int, directory: str, name: str, flags: int) -> int:
    """Open ``name`` in the directory (mode 0600 if created), checked before and after the open;
    :class:`FileNotFoundError` when missing or removed meanwhile, unless ``flags`` has O_CREAT."""
    for _attempt in range(8):
        try:
            problem = file_problem(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
            existed = True
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
            problem, existed = None, False
        if problem is not None:
            raise file_error(directory, name, problem)
        try:
            fd = os.open(name, flags | FILE_FLAGS, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            error = open_error(directory, name, exc, existed=existed)
            if error is None:
                raise
            raise error from None
        try:
            st = os.fstat(fd)
            gone = st.st_nlink == 0
            problem = None if gone else file_problem(st)
            if problem is not None:
                raise file_error(directory, name, problem)
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
