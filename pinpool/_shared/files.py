"""Where a shared memory region lives and the trust placed in it (docs/shared-memory.md, "Trust"): its file
system, a memfd, its directory (walked from ``/``) and its file, opened relative to the directory's descriptor."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Iterable

from .._errors import ConfigError
from .._host import libc as _libc
from .._host.files import FILE_FLAGS, regular_file_problem
from .format import (
    TEMP_MARK,
    NotRegion,
    describe,
    find_half_made,
    find_regions,
    is_temp_name,
    open_checked,
    read_region,
    read_trailer,
    region_info,
)

HUGE_PAGE_SIZES = {2 << 20: os.MFD_HUGE_2MB, 1 << 30: os.MFD_HUGE_1GB}
_FS_NAMES = {
    0xEF53: "ext2/3/4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x794C7630: "overlayfs", 0x6969: "nfs",
    0x858458F6: "ramfs", 0x65735546: "fuse", 0x01021997: "9p", 0xFF534D42: "cifs", 0x2FC12FC1: "zfs",
}  # fmt: skip


def page_size_of(f_type: int, f_bsize: int, where: str) -> int:
    """The page a region on this file system is made of, or :class:`ConfigError` for one it cannot live on."""
    if f_type == _libc.HUGETLBFS_MAGIC:
        return f_bsize
    if f_type == _libc.TMPFS_MAGIC:
        return _libc.PAGE_SIZE
    fs_name = _FS_NAMES.get(f_type, f"f_type {f_type:#x}")
    raise ConfigError(
        f"shared memory {where} is on a {fs_name} file system, not tmpfs or hugetlbfs: a pool's pages "
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
    """What makes a region's directory untrustworthy, or None (sticky: others may add names, not replace ours)."""
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


def region_file_problem(st: os.stat_result) -> str | None:
    return regular_file_problem(st, files="a region's file", linked="another name refers to the same memory")


def _refuse_directory(path: str, st: os.stat_result, at: str | None = None) -> None:
    """:class:`ConfigError` for an untrustworthy directory: the region's own, or ``at`` above it."""
    problem = _dir_problem(st)
    if problem is not None and at is not None:
        raise _refuse_ancestor(path, at, problem)
    if problem is not None:
        raise ConfigError(
            f"shared memory directory {os.path.dirname(path)!r} {problem}; use a directory this user owns that "
            f"only it can write (`chmod go-w`), or /dev/shm, for {path!r}"
        )


_MAX_LINKS = 40  # symbolic links followed in one walk, as the kernel's own limit
_WALK_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _refuse_ancestor(path: str, at: str, problem: str) -> ConfigError:
    return ConfigError(
        f"shared memory path {path!r}: {at!r} {problem}; another user could redirect the region through it. "
        "Use a path whose every directory belongs to this user or root (/dev/shm)"
    )


def _walk(path: str) -> int:
    """The directory of ``path``, opened from ``/`` one ``openat(O_NOFOLLOW)`` at a time, each checked."""
    directory = os.path.dirname(path)
    todo = [c for c in directory.split("/") if c][::-1]  # a stack: the next component last
    stack = [os.open("/", _WALK_FLAGS)]
    walked: list[str] = []
    links = 0
    try:
        _refuse_directory(path, os.fstat(stack[0]), "/")
        while todo:
            name = todo.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                    walked.pop()
                continue
            at = "/" + "/".join([*walked, name])
            try:
                st = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
            except OSError as exc:
                raise ConfigError(
                    f"shared memory directory {directory!r} of {path!r} cannot be used: {exc.strerror or exc} "
                    f"({at!r}); create it (mode 0700) or choose a path on /dev/shm"
                ) from None
            if stat.S_ISLNK(st.st_mode):
                if not todo:  # the region's own directory is never a link: its name is what a user checks
                    _refuse_directory(path, st)
                if st.st_uid not in (0, os.geteuid()):
                    raise _refuse_ancestor(path, at, f"is a symbolic link owned by uid {st.st_uid}")
                links += 1
                if links > _MAX_LINKS:
                    raise _refuse_ancestor(path, at, f"leads through more than {_MAX_LINKS} symbolic links")
                target = os.readlink(name, dir_fd=stack[-1])
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop())
                    walked.clear()
                todo.extend([c for c in target.split("/") if c][::-1])
                continue
            _refuse_directory(path, st, at if todo else None)
            stack.append(os.open(name, _WALK_FLAGS, dir_fd=stack[-1]))
            now = os.fstat(stack[-1])
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                raise _refuse_ancestor(path, at, "was replaced while being opened")
            walked.append(name)
        try:
            return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=stack[-1])
        except OSError as exc:
            raise ConfigError(
                f"shared memory directory {directory!r} cannot be opened: {exc.strerror or exc}"
            ) from None
    finally:
        for fd in stack:
            os.close(fd)


def open_region_directory(path: str) -> int:
    """The directory of ``path`` (:func:`_walk`), checked again once open (it may have changed)."""
    dir_fd = _walk(path)
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
    name = os.path.basename(path)
    try:
        problem = region_file_problem(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
    except FileNotFoundError:
        raise _file_error(
            path, "does not exist", "create it with create=True, or wait until its creator has (the path must exist)"
        ) from None
    if problem is not None:
        raise _file_error(path, problem)
    try:
        fd = os.open(name, os.O_RDWR | FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _file_error(path, "is a symbolic link (pinpool never follows links to a region's file)") from None
        if exc.errno == errno.ENOENT:
            raise _file_error(path, "was removed while being opened", "create it again, or retry") from None
        raise _file_error(path, f"cannot be opened for reading and writing ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        problem = "was removed while being opened" if st.st_nlink == 0 else region_file_problem(st)
        if problem is not None:
            raise _file_error(path, problem)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refuse_existing(dir_fd: int, path: str) -> None:
    name = os.path.basename(path)
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _file_error(path, f"cannot be checked ({exc.strerror or exc})", "check the directory") from None
    if stat.S_ISLNK(st.st_mode):
        raise _file_error(path, "exists already as a symbolic link (pinpool never follows one)")
    held = read_region(path, dir_fd=dir_fd)
    what = (
        f"holds a pinpool region already ({describe(held.nbytes, held.record)}, generation {held.generation})"
        if held is not None
        else "exists already"
    )
    raise _file_error(path, what, "attach to it with create=False, or remove it (`rm` it) if no process uses it")


def remove_stale_temps(dir_fd: int) -> list[tuple[str, int]]:
    """Remove region temporary files whose creators died (a live one holds ``LOCK_EX``): ``(name, bytes)``."""
    removed: list[tuple[str, int]] = []
    try:
        names = [n for n in os.listdir(dir_fd) if is_temp_name(n)]
    except OSError:
        return removed
    for temp in names:
        if (fd := open_checked(temp, dir_fd, os.O_RDONLY, region_file_problem)) is None:
            continue
        try:
            st = os.fstat(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if remove_file(dir_fd, temp, (st.st_dev, st.st_ino)):
                removed.append((temp, st.st_blocks * 512))
        except OSError:
            pass  # locked: its creator is at work
        finally:
            os.close(fd)
    return removed


def remove_half_made(directories: Iterable[str] | None = None) -> list[tuple[str, int]]:
    """:func:`remove_stale_temps` wherever :func:`find_half_made` finds a dead creator's file."""
    removed: list[tuple[str, int]] = []
    for directory in sorted({os.path.dirname(h.path) for h in find_half_made(directories) if not h.in_progress}):
        try:
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            removed += [(os.path.join(directory, name), held) for name, held in remove_stale_temps(dir_fd)]
        finally:
            os.close(dir_fd)
    return removed


def remove_orphans(directories: Iterable[str] | None = None) -> list[tuple[str, int]]:
    """Remove this user's orphaned regions (:attr:`RegionInfo.orphaned`) that were not kept: ``(path, bytes)``.

    Each is unlinked while holding ``LOCK_EX`` on it, after reading its trailer again under that lock: no
    pinpool process maps it then (a mapping holds ``LOCK_SH``), and an attacher that opened it meanwhile
    finds it unlinked once it gets its lock, and refuses it. A kept orphan is a warm restart's: never removed."""
    removed: list[tuple[str, int]] = []
    for region in find_regions(directories):
        if not region.orphaned or region.keep:
            continue
        directory, name = os.path.split(region.path)
        try:
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if (fd := open_checked(name, dir_fd, os.O_RDONLY, region_file_problem)) is None:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                st = os.fstat(fd)
                now = region_info(region.path, st, read_trailer(fd, st.st_size))
                if now.region_id == region.region_id and now.creator_alive is False and not now.keep:
                    if remove_file(dir_fd, name, (st.st_dev, st.st_ino)):
                        removed.append((region.path, st.st_blocks * 512))
            except (OSError, NotRegion):
                pass  # mapped, or attached to, or changed meanwhile: not an orphan to remove
            finally:
                os.close(fd)
        finally:
            os.close(dir_fd)
    return removed


_CREATE_TRIES = 8


def create_temp_file(dir_fd: int, path: str, mode: int) -> tuple[int, str]:
    """Refuse an existing name, remove dead creators' leftovers, create a locked temporary file: ``(fd, name)``."""
    name = os.path.basename(path)
    _refuse_existing(dir_fd, path)
    remove_stale_temps(dir_fd)
    for _attempt in range(_CREATE_TRIES):
        temp = f".{name[:200]}{TEMP_MARK}{secrets.token_hex(8)}"  # within NAME_MAX (255)
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | FILE_FLAGS, mode, dir_fd=dir_fd)
        except OSError as exc:
            raise _file_error(path, f"cannot be created ({exc.strerror or exc})", "check the directory") from None
        st = os.fstat(fd)
        identity = (st.st_dev, st.st_ino)
        try:
            if st.st_mode & 0o022:  # a umask never adds bits, but a default ACL may
                os.fchmod(fd, mode)
            # Until locked, another creation may take it for a dead creator's: then make another.

            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                ours = names_file(dir_fd, temp, identity)
            except BlockingIOError:
                ours = False
        except BaseException:
            os.close(fd)
            remove_file(dir_fd, temp, identity)
            raise
        if ours:
            return fd, temp
        os.close(fd)
        remove_file(dir_fd, temp, identity)
    raise _file_error(
        path, f"cannot be created: its temporary file was taken {_CREATE_TRIES} times as it was made",
        "check what else removes files in the directory",
    )  # fmt: skip


def publish(dir_fd: int, path: str, temp: str) -> None:
    """Give the complete region ``temp`` its name, never replacing a file that took it meanwhile."""
    name = os.path.basename(path)
    err = _libc.rename_noreplace(dir_fd, temp, name)
    if err in (errno.ENOSYS, errno.EINVAL):
        try:
            os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            err = 0
        except OSError as exc:
            err = exc.errno or errno.EIO
        if not err:
            os.unlink(temp, dir_fd=dir_fd)
    if err == errno.EEXIST:
        _refuse_existing(dir_fd, path)
    if err:
        raise _file_error(path, f"cannot be linked into place ({_libc.errno_name(err)})", "check the directory")


def names_file(dir_fd: int, path: str, identity: tuple[int, int] | None) -> bool:
    """Whether the name of ``path`` still refers to the file ``(st_dev, st_ino)``."""
    if identity is None:
        return False
    try:
        st = os.stat(os.path.basename(path), dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == identity


def remove_file(dir_fd: int, name: str, identity: tuple[int, int]) -> bool:
    """Remove the file ``identity`` by its name, if the name still refers to it; whether it did."""
    with contextlib.suppress(OSError):
        if names_file(dir_fd, name, identity):
            os.unlink(name, dir_fd=dir_fd)
            return True
    return False
