"""Where a shared memory region lives, and the trust placed in it: the page size of its file
system (tmpfs or hugetlbfs, nothing else), a new memfd, the region's directory (ours or root's,
not a symbolic link, not writable by others unless sticky), and its file: created exclusively
(``O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC``, mode 0600 by default; an existing name is a
:class:`ConfigError`) or opened to attach (``O_NOFOLLOW``; a regular file of ours with one link,
not writable by others, checked with ``lstat`` before the open and ``fstat`` after it). Files
are trusted as node pacing's lock files are (:mod:`pinpool._node_dir`). Every refusal is a
:class:`ConfigError` naming the path, the problem and the fix.

Every function takes the region's absolute ``path``; a file is opened by its name relative to
the directory's descriptor, never by a path that could be swapped.
"""

from __future__ import annotations

import errno
import os
import stat

from . import _libc
from ._errors import ConfigError
from ._node_dir import _FILE_FLAGS, regular_file_problem
from ._shared_regions import read_region
from ._shared_trailer import _describe

__all__ = [
    "check_directory",
    "create_region_file",
    "names_file",
    "new_memfd",
    "open_region_directory",
    "open_region_file",
    "page_size_of",
    "remove_file",
]

_HUGE_PAGE_SIZES = {2 << 20: os.MFD_HUGE_2MB, 1 << 30: os.MFD_HUGE_1GB}
_FS_NAMES = {
    0xEF53: "ext2/3/4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x794C7630: "overlayfs", 0x6969: "nfs",
    0x858458F6: "ramfs", 0x65735546: "fuse", 0x01021997: "9p", 0xFF534D42: "cifs", 0x2FC12FC1: "zfs",
}  # fmt: skip


def _fs_name(f_type: int) -> str:
    return _FS_NAMES.get(f_type, f"f_type {f_type:#x}")


def page_size_of(f_type: int, f_bsize: int, where: str) -> int:
    """The page a region on this file system is made of, or :class:`ConfigError` for one it cannot live on."""
    if f_type == _libc.HUGETLBFS_MAGIC:
        return f_bsize
    if f_type == _libc.TMPFS_MAGIC:
        return _libc.PAGE_SIZE
    raise ConfigError(
        f"shared memory {where} is on a {_fs_name(f_type)} file system, not tmpfs or hugetlbfs: a pool's pages "
        "must be memory, not a disk file's page cache. Use a path on /dev/shm (tmpfs) or on a hugetlbfs mount, "
        "or path=None for a memfd"
    )


def new_memfd(flags: int) -> int:
    """A new memfd (``memfd_create`` with ``flags``), or :class:`ConfigError` saying why not."""
    try:
        return os.memfd_create("pinpool-region", flags)
    except OSError as exc:
        huge = " with hugetlb pages (MFD_HUGETLB)" if flags & os.MFD_HUGETLB else ""
        raise ConfigError(f"memfd_create{huge} failed: {exc.strerror or exc}") from None


# -- the directory ----------------------------------------------------------------------------------


def _dir_problem(st: os.stat_result) -> str | None:
    """What makes a region's directory untrustworthy, or None. Ours or root's, and not writable by
    others unless sticky (``/dev/shm``, ``/tmp``: others may add names there, but may not remove or
    replace ours; the file itself is checked when opened)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (pinpool never follows a link to a region's directory)"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return (
            f"is group- or world-writable without the sticky bit (mode {stat.S_IMODE(st.st_mode):#o}): another "
            "user could replace the region's file"
        )
    if st.st_uid not in (os.geteuid(), 0):
        return f"is owned by uid {st.st_uid}, neither this process's uid {os.geteuid()} nor root"
    return None


def _region_file_problem(st: os.stat_result) -> str | None:
    """What makes an existing region file unusable, or None: the same rules as node pacing's lock
    files (a regular file of ours with one link, not writable by others)."""
    return regular_file_problem(st, files="a region's file", linked="another name refers to the same memory")


def _refuse_directory(path: str, st: os.stat_result) -> None:
    problem = _dir_problem(st)
    if problem is not None:
        raise ConfigError(
            f"shared memory directory {os.path.dirname(path)!r} {problem}; use a directory this user owns that "
            f"only it can write (`chmod go-w`), or /dev/shm, for {path!r}"
        )


def check_directory(path: str) -> None:
    """:class:`ConfigError` unless the directory of the region's file ``path`` can be trusted (``lstat``)."""
    directory = os.path.dirname(path)
    try:
        st = os.lstat(directory)
    except OSError as exc:
        raise ConfigError(
            f"shared memory directory {directory!r} of {path!r} cannot be used: "
            f"{exc.strerror or exc}; create it (mode 0700) or choose a path on /dev/shm"
        ) from None
    _refuse_directory(path, st)


def open_region_directory(path: str) -> int:
    """The directory of ``path``, opened ``O_DIRECTORY | O_NOFOLLOW`` and checked again (it may have changed)."""
    check_directory(path)
    directory = os.path.dirname(path)
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | _FILE_FLAGS)
    except OSError as exc:
        raise ConfigError(f"shared memory directory {directory!r} cannot be opened: {exc.strerror or exc}") from None
    try:
        _refuse_directory(path, os.fstat(dir_fd))
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd


# -- the file ---------------------------------------------------------------------------------------


def _file_error(path: str, problem: str, fix: str = "") -> ConfigError:
    fix = fix or "remove it if no process uses it (`rm` it; `pinpool doctor` lists regions), or choose another path"
    return ConfigError(f"shared memory file {path!r} {problem}; {fix}")


def open_region_file(dir_fd: int, path: str) -> int:
    """Open the region's file to attach (``O_RDWR``), checked before and after the open."""
    name = os.path.basename(path)
    try:
        problem = _region_file_problem(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
    except FileNotFoundError:
        raise _file_error(
            path, "does not exist", "create it with create=True, or wait until its creator has (the path must exist)"
        ) from None
    if problem is not None:
        raise _file_error(path, problem)
    try:
        fd = os.open(name, os.O_RDWR | _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _file_error(path, "is a symbolic link (pinpool never follows links to a region's file)") from None
        if exc.errno == errno.ENOENT:
            raise _file_error(path, "was removed while being opened", "create it again, or retry") from None
        raise _file_error(path, f"cannot be opened for reading and writing ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        problem = "was removed while being opened" if st.st_nlink == 0 else _region_file_problem(st)
        if problem is not None:
            raise _file_error(path, problem)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_region_file(dir_fd: int, path: str, mode: int) -> int:
    """Create the region's file exclusively (never following a link), with ``mode``."""
    name = os.path.basename(path)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, mode, dir_fd=dir_fd)
    except FileExistsError:
        try:
            link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        if link:
            raise _file_error(path, "exists already as a symbolic link (pinpool never follows one)") from None
        held = read_region(path)
        what = (
            f"holds a pinpool region already ({_describe(held.nbytes, held.record)}, generation {held.generation})"
            if held is not None
            else "exists already"
        )
        raise _file_error(
            path, what, "attach to it with create=False, or remove it (`rm` it) if no process uses it"
        ) from None
    except OSError as exc:
        raise _file_error(path, f"cannot be created ({exc.strerror or exc})", "check the directory") from None
    try:
        if os.fstat(fd).st_mode & 0o022:  # a umask never adds bits, but a default ACL may
            os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def names_file(dir_fd: int, path: str, identity: tuple[int, int] | None) -> bool:
    """Whether the name of ``path`` still refers to the file ``identity`` (``(st_dev, st_ino)``) describes."""
    if identity is None:
        return False
    try:
        st = os.stat(os.path.basename(path), dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == identity


def remove_file(dir_fd: int, name: str, identity: tuple[int, int]) -> None:
    """Remove a file this process just created and could not make a region of (if the name still refers to it)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == identity:
            os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
