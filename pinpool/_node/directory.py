"""Node pacing's directory and the trust placed in it: :func:`open_directory` creates and checks
the directory, ``_open_file`` opens and checks one lock file in it. Every refusal is a
:class:`ConfigError` naming the path, what is wrong and the fix.

The directory is created with mode 0700 when missing; an existing one must be a real directory
(not a symlink), owned by this process's effective uid, not group- or world-writable, and
writable and searchable by this process. It is opened ``O_DIRECTORY | O_NOFOLLOW`` and every
file is opened relative to that descriptor with ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC`` (mode
0600, never ``O_TRUNC``): a FIFO, socket or device planted under a lock file's name is seen by
``lstat`` before the open and by ``fstat`` after it, and the open never waits for a writer.
Before a byte is read, written or truncated, or a lock taken, ``fstat`` must show a regular
file with one link (a hard link in place of a slot file would make pinpool overwrite the file
it names), owned by us and not group- or world-writable; anything else is a
:class:`ConfigError` naming the file and telling to remove it. ``O_NONBLOCK`` stays set: it
changes nothing for a regular file, the only kind used. pinpool never changes the mode of a
directory it did not create. Every rank must therefore run as the same user.

The checks on one file or directory are :mod:`pinpool._host.files`, shared with shared memory's
region files.
"""

from __future__ import annotations

import errno
import os
import stat

from .._errors import ConfigError
from .._host.files import FILE_FLAGS, owner_problem, regular_file_problem
from .config import DIR_ENV, default_directory

__all__ = ["open_directory"]


def _file_problem(st: os.stat_result) -> str | None:
    """What makes a lock file unusable, or None: pinpool reads, writes, truncates and locks only a
    regular file of ours with one link."""
    return regular_file_problem(
        st, files="its lock files",
        linked="another name refers to the same file, and pinpool writes into its lock files",
    )  # fmt: skip


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
            fd = os.open(name, flags | FILE_FLAGS, 0o600, dir_fd=dir_fd)
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
