"""The few libc calls pinpool needs, through ctypes (which releases the GIL around each call), and the
pin workers' lower CPU priority (:func:`lower_this_thread`)."""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import resource
import sys
import threading
from typing import Any

PAGE_SIZE = mmap.PAGESIZE
HUGE_PAGE_SIZE = 2 << 20

PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value

MAP_HUGETLB = 0x40000
_MAP_HUGE = {2 << 20: 21 << 26, 1 << 30: 30 << 26}  # MAP_HUGE_2MB, MAP_HUGE_1GB: log2(page) << MAP_HUGE_SHIFT

MADV_DONTNEED = 4  # drop private pages: the memory goes back to the host, the range reads zero after
MADV_REMOVE = 9  # punch a hole in a shared mapping's file (FALLOC_FL_PUNCH_HOLE): every process's view drops
MADV_DONTFORK = 10  # a forked child gets no copy of the range (not even copy-on-write)
MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22  # Linux >= 5.14
MADV_POPULATE_WRITE = 23  # Linux >= 5.14

MLOCK_ONFAULT = 1

# statfs(2) f_type of the file systems a shared region may live on (linux/magic.h).
TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
MPOL_BIND = 2
MPOL_MF_STRICT = 1

# Syscall numbers glibc may not wrap (mbind never; mlock2 only since 2.27).
_SYSCALLS = {"x86_64": {"mlock2": 325, "mbind": 237}, "aarch64": {"mlock2": 284, "mbind": 235}}
_MACHINE = os.uname().machine

CAP_IPC_LOCK = 14
CAP_SYS_RESOURCE = 24  # PSI triggers with windows other than multiples of 2 s
RLIM_INFINITY = resource.RLIM_INFINITY

_libc = ctypes.CDLL(None, use_errno=True)

# User address space without an mmap hint above it (pinpool never passes one), an upper bound: x86-64
# 2**47 even with LA57, arm64 2**48 even with 52-bit VA, any other 64-bit one 2**57; 32-bit: the pointer.
_USER_ADDRESS_BITS = {"x86_64": 47, "amd64": 47, "aarch64": 48, "arm64": 48}
_OTHER_64_BIT_ADDRESS_BITS = 57


@functools.cache
def address_space_bytes(machine: str | None = None) -> int:
    pointer_bits = ctypes.sizeof(ctypes.c_void_p) * 8
    if pointer_bits < 64:
        return 1 << pointer_bits
    return 1 << _USER_ADDRESS_BITS.get(machine or _MACHINE, _OTHER_64_BIT_ADDRESS_BITS)


def _function(name: str, restype: Any, *argtypes: Any) -> Any:
    function = getattr(_libc, name)
    function.argtypes, function.restype = list(argtypes), restype
    return function


_void_p, _size_t, _int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
_mmap = _function("mmap", _void_p, _void_p, _size_t, _int, _int, _int, ctypes.c_long)
_munmap = _function("munmap", _int, _void_p, _size_t)
_madvise = _function("madvise", _int, _void_p, _size_t, _int)
_mlock = _function("mlock", _int, _void_p, _size_t)
_munlock = _function("munlock", _int, _void_p, _size_t)
_STATFS_BYTES = 256  # struct statfs is 120 bytes on 64-bit Linux; f_type and f_bsize are its first two longs
_statfs = _function("statfs", _int, ctypes.c_char_p, _void_p)
_fstatfs = _function("fstatfs", _int, _int, _void_p)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _syscall_number(name: str) -> int | None:
    return _SYSCALLS.get(_MACHINE, {}).get(name)


def _check(rc: int) -> int:
    """0 on success, else the errno of the call that just returned ``rc``."""
    return 0 if rc == 0 else ctypes.get_errno()


def _map(length: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> tuple[int, int]:
    """``mmap``; returns ``(address, 0)`` or ``(0, errno)``."""
    ctypes.set_errno(0)
    address = _mmap(None, length, prot, flags, fd, offset)
    if address is None or address == MAP_FAILED:
        return 0, ctypes.get_errno()
    return int(address), 0


def mmap_anonymous(length: int, *, noreserve: bool = False) -> tuple[int, int]:
    """Private anonymous memory; ``noreserve``: not charged to the commit limit until touched (MAP_NORESERVE:
    the heuristic overcommit mode refuses one mapping larger than RAM + swap without it; strict mode ignores it)."""
    return _map(length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | (MAP_NORESERVE if noreserve else 0))


def mmap_hugetlb(length: int, page_size: int = HUGE_PAGE_SIZE) -> tuple[int, int]:
    """Map ``length`` bytes from the hugetlb pool of ``page_size`` pages (the mapping comes aligned to it)."""
    return _map(length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | _MAP_HUGE[page_size])


def mmap_shared(length: int, fd: int, offset: int = 0, *, writable: bool = True) -> tuple[int, int]:
    """``MAP_SHARED`` of the file ``fd``; on hugetlbfs, whole huge pages, huge-page-aligned."""
    return _map(length, PROT_READ | (PROT_WRITE if writable else 0), MAP_SHARED, fd, offset)


def statfs(path: str) -> tuple[int, int]:
    """``(f_type, f_bsize)`` of the file system holding ``path`` (f_bsize: the huge page on hugetlbfs)."""
    return _statfs_of(_statfs, os.fsencode(path))


def fstatfs(fd: int) -> tuple[int, int]:
    return _statfs_of(_fstatfs, fd)


def _statfs_of(call: Any, target: bytes | int) -> tuple[int, int]:
    buffer = ctypes.create_string_buffer(_STATFS_BYTES)
    ctypes.set_errno(0)
    if call(target, buffer) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    longs = (ctypes.c_long * 2).from_buffer(buffer)
    return longs[0] & 0xFFFFFFFF, int(longs[1])  # f_type compared as the unsigned magic


RENAME_NOREPLACE = 1
_renameat2 = getattr(_libc, "renameat2", None)  # glibc 2.28+
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int


def rename_noreplace(dir_fd: int, old: str, new: str) -> int:
    """``renameat2(RENAME_NOREPLACE)`` within ``dir_fd``: 0 or the errno (ENOSYS, EINVAL: unsupported)."""
    if _renameat2 is None:
        return errno.ENOSYS
    ctypes.set_errno(0)
    return _check(_renameat2(dir_fd, os.fsencode(old), dir_fd, os.fsencode(new), RENAME_NOREPLACE))


def mlock_on_fault(address: int, length: int) -> int:
    """mlock2(MLOCK_ONFAULT): lock resident pages now and every other page as it is faulted in."""
    number = _syscall_number("mlock2")
    if number is None:
        return errno.ENOSYS
    ctypes.set_errno(0)
    rc = _syscall(ctypes.c_long(number), ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.c_int(MLOCK_ONFAULT))
    return _check(int(rc))


def mbind(address: int, length: int, node: int) -> int:
    """Bind ``[address, +length)`` to NUMA ``node`` (MPOL_BIND) before it is faulted in."""
    number = _syscall_number("mbind")
    if number is None:
        return errno.ENOSYS
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    mask = (ctypes.c_ulong * (node // bits + 1))()
    mask[node // bits] = 1 << (node % bits)
    ctypes.set_errno(0)
    rc = _syscall(
        ctypes.c_long(number), ctypes.c_void_p(address), ctypes.c_ulong(length), ctypes.c_int(MPOL_BIND),
        mask, ctypes.c_ulong(len(mask) * bits + 1), ctypes.c_uint(MPOL_MF_STRICT),
    )  # fmt: skip
    return _check(int(rc))


def numa_nodes() -> tuple[int, ...]:
    """The NUMA nodes with memory, per /sys (``(0,)`` on a kernel without NUMA)."""
    try:
        with open("/sys/devices/system/node/has_memory") as online:
            text = online.read().strip()
    except OSError:
        return (0,)
    nodes: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        nodes.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(nodes)


def hugetlb_free_pages(page_size: int = HUGE_PAGE_SIZE) -> tuple[int, int]:
    """``(free, total)`` hugetlb pages of ``page_size`` from /sys/kernel/mm/hugepages; ``(0, 0)`` without."""
    free = total = 0
    folder = f"/sys/kernel/mm/hugepages/hugepages-{page_size >> 10}kB"
    try:
        with open(f"{folder}/free_hugepages") as f:
            free = int(f.read())
        with open(f"{folder}/nr_hugepages") as f:
            total = int(f.read())
    except OSError:
        pass
    return free, total


def munmap(address: int, length: int) -> int:
    return _check(_munmap(address, length))


def madvise(address: int, length: int, advice: int) -> int:
    return _check(_madvise(address, length, advice))


def mlock(address: int, length: int) -> int:
    return _check(_mlock(address, length))


def munlock(address: int, length: int) -> int:
    return _check(_munlock(address, length))


def errno_name(code: int) -> str:
    return errno.errorcode.get(code, f"E{code}")


def has_cap_ipc_lock() -> bool:
    """Whether this process's effective capabilities include CAP_IPC_LOCK (mlock past the limit)."""
    return has_capability(CAP_IPC_LOCK)


def has_capability(bit: int) -> bool:
    """Whether this process's effective capabilities include capability number ``bit``."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def memlock_limits() -> tuple[int, int]:
    return resource.getrlimit(resource.RLIMIT_MEMLOCK)


def format_rlimit(value: int) -> str:
    return "unlimited" if value == RLIM_INFINITY else f"{value} bytes"


def vm_locked_bytes() -> int:
    """This process's locked memory (``VmLck`` in /proc/self/status), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmLck not found in /proc/self/status")


_populate_supported: bool | None = None
_populate_probe_lock = threading.Lock()


def populate_write_supported() -> bool:
    """Whether the kernel knows MADV_POPULATE_WRITE, probed once on a one-page mapping, through the raw
    calls: a test faking ``madvise``/``munmap`` (the pool memory's seam) never sees the probe."""
    global _populate_supported
    with _populate_probe_lock:
        if _populate_supported is None:
            address, err = mmap_anonymous(PAGE_SIZE)
            if err:
                return False
            try:
                _populate_supported = _madvise(address, PAGE_SIZE, MADV_POPULATE_WRITE) == 0
            finally:
                _munmap(address, PAGE_SIZE)
        return _populate_supported


def sysfs_choice(path: str) -> str | None:
    """The selected value of a sysfs choice file (``always [madvise] never``: ``madvise``), or None."""
    try:
        with open(path) as setting:
            text = setting.read(1 << 16)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def transparent_huge_pages_mode() -> str | None:
    """The transparent huge pages mode ("always", "madvise", "never"), or None without THP."""
    return sysfs_choice("/sys/kernel/mm/transparent_hugepage/enabled")


# -- pin workers' priority (docs/serving.md) -------------------------------------------------------
# Pinning is CPU work that takes the serving threads' CPU. Lowering nice again needs privilege, so
# only fresh pin workers are niced, never the caller's thread nor unpin workers. Nice, not SCHED_IDLE:
# an idle-class thread may starve while holding what serving needs (the GIL, mmap_lock, CUDA's lock).

_log = logging.getLogger("pinpool")
_nice_reported = threading.Event()


def lower_this_thread(increment: int) -> int | None:
    """Add ``increment`` to the calling thread's nice value (capped); the value now in effect, or None
    when nothing changed (``increment <= 0``, not Linux, or refused: logged once at debug)."""
    if increment <= 0:
        return None
    if not sys.platform.startswith("linux"):  # elsewhere a thread id is not a process id
        _report_nice_once(f"per-thread priorities are Linux-only (platform {sys.platform})")
        return None
    try:
        tid = threading.get_native_id()  # Linux caps nice at 19 itself: the value in effect is read back
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError as exc:  # EPERM/EACCES under a seccomp filter or an LSM: pin at the inherited priority
        _report_nice_once(f"setpriority failed: {type(exc).__name__}: {exc}")
        return None


def _report_nice_once(why: str) -> None:
    if _nice_reported.is_set():
        return
    _nice_reported.set()
    try:
        _log.debug("pinpool: pin workers run at the process's priority (pin_nice not applied): %s", why)
    except Exception:
        pass  # a broken logging setup must not fail pinning
