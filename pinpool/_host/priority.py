"""Pin worker threads at a lower CPU priority than the rest of the process (``pin_nice=``).

A background pool pins while its process serves. Pinning is CPU work (the kernel faults and
zeroes every page), and its workers used to run at the process's own priority, so on a small
host they took the serving threads' CPU: the example server's ``/healthz`` p99 rose 4x while
a 4 GiB pool pinned on 2 cores. A pin worker therefore raises its own nice value when it
starts (:func:`lower_this_thread`).

On Linux, ``setpriority(PRIO_PROCESS, tid, n)`` with a thread id changes that thread alone (a
thread is a task with its own nice value). Raising nice needs no privilege; lowering it
again does (CAP_SYS_NICE or RLIMIT_NICE), so it is only ever done to threads whose one job is
pinning: pinpool starts fresh worker threads for every pinning, and never lowers the thread
that entered the pool. Unpin (teardown and rollback) workers are not lowered: a server
waits for them at shutdown, and they are short.

Nice, not SCHED_IDLE: an idle-class thread runs only when a CPU has nothing else to do, so on
a busy server it could wait for ever, and while it waits it may hold what the serving
threads need (the GIL between calls, or, inside a call, the process's ``mmap_lock`` or the
CUDA driver's lock). A niced thread still gets its weighted share (nice 10: about a tenth of
a nice-0 thread's), so every lock it holds is released within a bounded time. See
docs/serving.md and the measurements in docs/performance.md.

Where the priority cannot be changed (a seccomp filter, a platform without per-thread
nice), pinning goes on at the inherited priority: that is logged once per process, at
debug level, and never fails the pool.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from .._plan.options import MAX_NICE

__all__ = ["lower_this_thread", "thread_nice"]


_log = logging.getLogger("pinpool")
_reported = threading.Event()


def thread_nice(tid: int | None = None) -> int:
    """The nice value of thread ``tid`` (default: the calling thread), as the kernel sees it."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id() if tid is None else tid)


def lower_this_thread(increment: int) -> int | None:
    """Add ``increment`` to the calling thread's nice value (capped at 19); return the nice
    value now in effect, or None when nothing was changed (``increment <= 0``, a platform
    without per-thread priorities, or the kernel refused: logged once per process at debug).

    Call it only at the start of a thread that pinpool owns and that does nothing else: the
    change cannot be undone without privileges, and threads it starts inherit it."""
    if increment <= 0:
        return None
    if not sys.platform.startswith("linux"):
        # Elsewhere a thread id is not a process id: setpriority would reach another process or fail.
        _report_once(f"per-thread priorities are Linux-only (platform {sys.platform})")
        return None
    try:
        tid = threading.get_native_id()
        target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as exc:  # EPERM/EACCES under a seccomp filter or an LSM: pin at the inherited priority
        _report_once(f"setpriority failed: {type(exc).__name__}: {exc}")
        return None
    return target


def _report_once(why: str) -> None:
    if _reported.is_set():
        return
    _reported.set()
    try:
        _log.debug("pinpool: pin workers run at the process's priority (pin_nice not applied): %s", why)
    except Exception:
        pass  # a broken logging setup must not fail pinning
