"""The trust pinpool places in a file it keeps (node pacing's lock files, shared memory's region
files): a regular file of ours with one link, not writable by others, opened without following
links and without waiting on a FIFO."""

from __future__ import annotations

import os
import stat

__all__ = ["FILE_FLAGS", "owner_problem", "regular_file_problem"]

# O_NONBLOCK: opening a FIFO never waits for its other end (regular files ignore the flag).
FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def owner_problem(st: os.stat_result) -> str | None:
    """What makes a directory or file we found untrustworthy, or None."""
    euid = os.geteuid()
    if st.st_uid != euid:
        return f"is owned by uid {st.st_uid}, not by this process's uid {euid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is group- or world-writable (mode {stat.S_IMODE(st.st_mode):#o})"
    return None


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def regular_file_problem(st: os.stat_result, *, files: str, linked: str) -> str | None:
    """What makes a file pinpool keeps unusable, or None. ``files``, ``linked``: for the messages."""
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return f"is a symbolic link (pinpool never follows links to {files})"
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), f"file type {stat.S_IFMT(mode):#o}")
        return f"is not a regular file ({kind})"
    if st.st_nlink > 1:
        return f"has {st.st_nlink} hard links ({linked})"
    return owner_problem(st)
