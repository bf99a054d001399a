"""Raw host memory and host facts for the benchmark's baselines, with the stdlib only.

The baselines must pin memory the way the field does, without pinpool: an anonymous private
mapping (``mmap``), faulted in with ``madvise(MADV_POPULATE_WRITE)`` on threads (through
ctypes, which releases the GIL for the call; ``mmap.mmap.madvise`` holds it, which would
serialise the threads), and registered with the runtime's public ``register``. Also the one way
every benchmark hands over its results (:func:`publish`).
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import platform
import threading
from collections.abc import Callable, Sequence
from types import TracebackType

PAGE_SIZE = mmap.PAGESIZE
SPAN = 512 << 20  # one populate call's bytes, as pinpool's own spans: mmap_lock is never held long
MADV_POPULATE_WRITE: int = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python >= 3.12 names it

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int


class AnonymousMemory:
    """``nbytes`` of fresh private anonymous memory (``mmap.mmap(-1, n)``), page-aligned, untouched."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(view)
        del view  # release the buffer export, or close() refuses to unmap

    def close(self) -> None:
        self._map.close()

    def __enter__(self) -> AnonymousMemory:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _populate_supported() -> bool:
    with AnonymousMemory(PAGE_SIZE) as probe:
        return bool(_madvise(probe.address, PAGE_SIZE, MADV_POPULATE_WRITE) == 0)


POPULATE_WRITE = _populate_supported()
FIRST_TOUCH = "MADV_POPULATE_WRITE" if POPULATE_WRITE else "memset (no MADV_POPULATE_WRITE on this kernel)"


def first_touch(ptr: int, nbytes: int) -> None:
    """Fault ``[ptr, +nbytes)`` in writable on the calling thread (page-aligned ``ptr``)."""
    if not POPULATE_WRITE:
        ctypes.memset(ptr, 0, nbytes)  # writes every byte; faults every page on the way
        return
    if _madvise(ptr, nbytes, MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of {nbytes} bytes at {ptr:#x}: {errno.errorcode.get(err)}")


def spans(base: int, size: int, span: int = SPAN) -> list[tuple[int, int]]:
    """``[base, +size)`` cut into ``(ptr, nbytes)`` pieces of at most ``span`` bytes."""
    return [(base + offset, min(span, size - offset)) for offset in range(0, size, span)]


def parallel(fn: Callable[[int, int], None], ranges: Sequence[tuple[int, int]], threads: int) -> None:
    """Run ``fn(ptr, nbytes)`` over ``ranges`` on ``threads`` threads pulling from one queue."""
    pending = iter(ranges)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work() -> None:
        while True:
            with lock:
                item = next(pending, None)
            if item is None:
                return
            try:
                fn(*item)
            except BaseException as exc:
                errors.append(exc)
                return

    workers = [threading.Thread(target=work) for _ in range(max(1, threads))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # non-Linux
        return os.cpu_count() or 1


def transparent_huge_pages_mode() -> str | None:
    """The bracketed mode of /sys/kernel/mm/transparent_hugepage/enabled, or None without THP."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            text = setting.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def format_bytes(nbytes: int) -> str:
    """``2.5 GiB``, ``300 MiB``, ``17 B`` (as pinpool's own messages write sizes)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            text = f"{nbytes / scale:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
    return f"{nbytes} B"


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (
        f"{platform.machine()}, {available_cpus()} CPUs, {format_bytes(mem)} RAM, Linux {platform.release()}, "
        f"Python {platform.python_version()}, THP {transparent_huge_pages_mode()}"
    )


def publish(text: str, result: object, *, json_path: str | None, markdown_path: str | None) -> None:
    """Print a benchmark's markdown report, and write it and the raw result where asked."""
    print(text)
    if json_path:
        with open(json_path, "w") as out:
            json.dump(result, out, indent=2)
    if markdown_path:
        with open(markdown_path, "w") as out:
            out.write(text + "\n")
