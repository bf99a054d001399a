"""The pool's own memory: one anonymous mapping, viewed as torch tensors without copying.

Lifetime rule: the mapping is unmapped only when nothing refers to it any more: not the
pool (which lets go after every chunk is unregistered) and not any tensor view (each view
holds it through the buffer object torch.frombuffer keeps alive). A tensor kept past the
pool's exit therefore stays valid, merely unpinned. A mapping whose chunks could not all
be unregistered is never unmapped: freeing still-registered memory is undefined.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import Any

import torch

from . import _libc
from ._errors import ConfigError, PinpoolError, RuntimeCallError
from ._plan import check_hugetlb_pages, check_thp_mode
from ._units import format_bytes


class AllocationError(PinpoolError, MemoryError):
    """The operating system refused to map the pool's memory."""


# Mappings that must outlive everything because a chunk of them may still be registered.
_KEPT_FOREVER: list[HostMapping] = []
_kept_lock = threading.Lock()


def _unmap(address: int, length: int) -> None:
    _libc.munmap(address, length)


def populate_range(ptr: int, nbytes: int) -> None:
    """Fault in ``[ptr, ptr+nbytes)`` writable (MADV_POPULATE_WRITE), on the calling thread."""
    aligned = ptr - ptr % _libc.PAGE_SIZE  # madvise wants a page-aligned start (a caller's tensor may not be)
    err = _libc.madvise(aligned, nbytes + (ptr - aligned), _libc.MADV_POPULATE_WRITE)
    if err:
        raise RuntimeCallError(
            op="madvise(MADV_POPULATE_WRITE)", code=err, reason=_libc.errno_name(err), ptr=ptr, nbytes=nbytes,
            message=f"{os.strerror(err)}: the kernel could not fault in {format_bytes(nbytes)}; "
            "the host is probably short of memory",
        )  # fmt: skip


def check_huge_pages_available() -> None:
    """huge_pages=True needs transparent huge pages in 'always' or 'madvise' mode (read now)."""
    check_thp_mode(_libc.transparent_huge_pages_mode())


def check_hugetlb_available(nbytes: int) -> None:
    """huge_pages='hugetlb' needs enough free 2 MiB pages reserved in the hugetlb pool (read now)."""
    free, total = _libc.hugetlb_free_pages()
    check_hugetlb_pages(nbytes, free=free, total=total, huge_page_size=_libc.HUGE_PAGE_SIZE)


class HostMapping:
    """``nbytes`` of private anonymous memory, page-aligned (2 MiB-aligned with huge pages).

    ``huge_pages``: ``True`` asks for transparent huge pages (MADV_HUGEPAGE), ``"hugetlb"``
    maps reserved 2 MiB hugetlb pages. ``numa_node`` binds the memory (mbind) before any of it
    is faulted.
    """

    def __init__(self, nbytes: int, *, huge_pages: bool | str = False, numa_node: int | None = None) -> None:
        if huge_pages is True:
            check_huge_pages_available()
        align = _libc.HUGE_PAGE_SIZE if huge_pages else _libc.PAGE_SIZE
        length = -(-nbytes // align) * align
        if huge_pages == "hugetlb":
            check_hugetlb_available(length)
            address, err = _libc.mmap_hugetlb(length)  # hugetlb mappings come 2 MiB-aligned
            if err:
                raise AllocationError(
                    f"mmap of {format_bytes(length)} of hugetlb pages failed: {_libc.errno_name(err)} "
                    f"({os.strerror(err)}); reserve more 2 MiB pages (vm.nr_hugepages) or use huge_pages=True"
                )
        else:
            address, err = self._map_aligned(length, align)
        self.address = address
        self.length = length
        self.nbytes = nbytes
        self.huge_pages = huge_pages
        self._finalizer = weakref.finalize(self, _unmap, address, length)
        if huge_pages is True:
            err = _libc.madvise(address, length, _libc.MADV_HUGEPAGE)
            if err:
                self._finalizer()
                raise ConfigError(f"madvise(MADV_HUGEPAGE) failed: {_libc.errno_name(err)}; use huge_pages=False")
        if numa_node is not None:
            err = _libc.mbind(address, length, numa_node)
            if err:
                self._finalizer()
                raise ConfigError(
                    f"mbind of the pool's memory to numa_node={numa_node} failed: {_libc.errno_name(err)} "
                    f"({os.strerror(err)}); check the node has memory (numactl -H) or use numa_node=None"
                )

    @staticmethod
    def _map_aligned(length: int, align: int) -> tuple[int, int]:
        slack = align - _libc.PAGE_SIZE
        raw, err = _libc.mmap_anonymous(length + slack)
        if err:
            raise AllocationError(
                f"mmap of {format_bytes(length + slack)} failed: {_libc.errno_name(err)} ({os.strerror(err)}); "
                "the host cannot provide that much address space or memory (check vm.overcommit_memory and ulimit -v)"
            )
        address = -(-raw // align) * align
        if address > raw:
            _libc.munmap(raw, address - raw)
        if raw + length + slack > address + length:
            _libc.munmap(address + length, raw + length + slack - (address + length))
        return address, 0

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor over ``[offset, offset+nbytes)`` that keeps this mapping alive."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.length:
            raise ValueError(f"view [{offset}, +{nbytes}) outside the mapping of {self.length} bytes")
        buffer_type: Any = type("_PoolBytes", (ctypes.c_uint8 * nbytes,), {})  # a subclass can carry _owner
        buffer = buffer_type.from_address(self.address + offset)
        buffer._owner = self  # the tensor's storage holds `buffer`, `buffer` holds the mapping
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def keep_forever(self) -> None:
        """Never unmap: part of this memory may still be registered with the runtime."""
        with _kept_lock:
            _KEPT_FOREVER.append(self)

    @property
    def unmapped(self) -> bool:
        return not self._finalizer.alive


class TensorMemory:
    """A caller's contiguous CPU tensor as pool memory: same interface as HostMapping, never freed.

    The tensor is referenced until the pool is closed (and forever if a chunk leaked), so its
    memory cannot be released while pinned.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.address = int(tensor.data_ptr())
        self.nbytes = tensor.numel() * tensor.element_size()
        self.length = self.nbytes
        self.huge_pages: bool | str = False

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        flat = self.tensor.reshape(-1).view(torch.uint8)
        return flat[offset : offset + nbytes]

    def keep_forever(self) -> None:
        with _kept_lock:
            _KEPT_FOREVER.append(self)  # type: ignore[arg-type]

    @property
    def unmapped(self) -> bool:
        return False
