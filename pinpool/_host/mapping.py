"""The pool's own memory: one anonymous mapping, viewed as torch tensors without copying, unmapped only when
nothing refers to it (the pool, or any view), never while a chunk is registered nor at interpreter exit
(finalizers run newest first then: a mapping would go before its pool unpinned it). Or a caller's tensor,
pinned through an *alias* whose storage cannot be resized: ``t.resize_()`` raises instead of freeing the
pinned memory under its registrations (docs/concepts.md has both lifetimes).
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from .._errors import AllocationError, ConfigError, PoolStateError, RuntimeCallError, hugetlb_fix
from .._units import format_bytes, hugetlb_page_size, shown
from . import libc as _libc
from .giveback import checked_range, give_back

_KEPT_FOREVER: list[HostMapping] = []
_kept_lock = threading.Lock()


# munmap holds the process's mmap_lock for writing while it frees the range, stalling every thread
# that maps or faults memory: in pieces (whole pages: hugetlb ones for hugetlb), the lock is let go.
UNMAP_PIECE_BYTES = 128 << 20


def unmap_in_pieces(address: int, length: int, page: int = _libc.PAGE_SIZE) -> None:
    piece = -(-UNMAP_PIECE_BYTES // page) * page  # 1 GiB pages: one page per piece
    for offset in range(0, length, piece):
        _libc.munmap(address + offset, min(piece, length - offset))


def populate_range(ptr: int, nbytes: int, advice: int = _libc.MADV_POPULATE_WRITE) -> None:
    """Fault in ``[ptr, ptr+nbytes)`` on the calling thread: writable (MADV_POPULATE_WRITE), or
    readable (MADV_POPULATE_READ: a shared file's pages, resident already, need no write fault)."""
    aligned = ptr - ptr % _libc.PAGE_SIZE  # madvise wants a page-aligned start (a caller's tensor may not be)
    err = _libc.madvise(aligned, nbytes + (ptr - aligned), advice)
    if err:
        name = "MADV_POPULATE_WRITE" if advice == _libc.MADV_POPULATE_WRITE else "MADV_POPULATE_READ"
        raise RuntimeCallError(
            op=f"madvise({name})", code=err, reason=_libc.errno_name(err), ptr=ptr, nbytes=nbytes,
            message=f"{os.strerror(err)}: the kernel could not fault in {format_bytes(nbytes)}; "
            "the host is probably short of memory",
        )  # fmt: skip


def owned_bytes(address: int, nbytes: int, owner: object) -> Any:
    """A ctypes array over ``[address, +nbytes)`` that keeps ``owner`` alive: a tensor made from it
    (``torch.frombuffer``) holds the array, the array holds the owner."""
    buffer_type: Any = type("_OwnedBytes", (ctypes.c_uint8 * nbytes,), {})  # a subclass can carry _owner
    buffer = buffer_type.from_address(address)
    buffer._owner = owner
    return buffer


def _unmap_in(pid: int, address: int, length: int, page: int) -> None:
    """Unmap, in the process that mapped it only: a forked child has no copy (MADV_DONTFORK), and
    whatever it has mapped at that address since is its own."""
    if os.getpid() == pid:
        unmap_in_pieces(address, length, page)


class HostMapping:
    """``nbytes`` of private anonymous memory, page-aligned (huge-page-aligned with huge pages, hugetlb ones
    checked by the caller first), bound to ``numa_node`` and ``MADV_DONTFORK`` before any page is faulted:
    a fork never shares a pinned page copy-on-write (docs/concepts.md)."""

    def __init__(
        self, nbytes: int, *, huge_pages: bool | str = False, numa_node: int | None = None, reservation: bool = False
    ) -> None:
        hugetlb = hugetlb_page_size(huge_pages)
        align = hugetlb or (_libc.HUGE_PAGE_SIZE if huge_pages else _libc.PAGE_SIZE)
        length = -(-nbytes // align) * align
        if hugetlb:
            address, err = _libc.mmap_hugetlb(length, hugetlb)  # hugetlb mappings come aligned to their page
            if err:
                raise AllocationError(
                    f"mmap of {format_bytes(length)} of {format_bytes(hugetlb)} hugetlb pages failed: "
                    f"{_libc.errno_name(err)} ({os.strerror(err)}); reserve more {format_bytes(hugetlb)} pages "
                    f"({hugetlb_fix(hugetlb, 'N')}) or use huge_pages=True"
                )
        else:
            # An elastic pool's reservation may be larger than the host: only what is grown is ever touched.
            address, err = self._map_aligned(length, align, noreserve=reservation)
        self.address = address
        self.length = length
        self.nbytes = nbytes
        self.huge_pages = huge_pages
        self._finalizer = weakref.finalize(self, _unmap_in, os.getpid(), address, length, hugetlb or _libc.PAGE_SIZE)
        self._finalizer.atexit = False  # never at interpreter exit (see the module doc)
        err = _libc.madvise(address, length, _libc.MADV_DONTFORK)
        if err:
            self._finalizer()
            raise AllocationError(
                f"madvise(MADV_DONTFORK) of the {format_bytes(length)} mapping failed: {_libc.errno_name(err)} "
                f"({os.strerror(err)}); it was unmapped and nothing was pinned. ENOMEM here means the process "
                "has too many mappings (raise vm.max_map_count)"
            )
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
    def _map_aligned(length: int, align: int, *, noreserve: bool = False) -> tuple[int, int]:
        slack = align - _libc.PAGE_SIZE
        raw, err = _libc.mmap_anonymous(length + slack, noreserve=noreserve)
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
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(owned_bytes(self.address + offset, nbytes, self), dtype=torch.uint8)

    def give_back(self, offset: int, nbytes: int) -> None:
        """Give ``[offset, +nbytes)`` back to the host (``MADV_DONTNEED``), once unpinned: whole pages (hugetlb
        or transparent huge ones with huge pages); it reads zero after, and can be touched and pinned again."""
        if self.unmapped:
            raise PoolStateError("the pool's memory was unmapped: there is nothing left to give back")
        hugetlb = hugetlb_page_size(self.huge_pages)
        granule, kind = (
            (hugetlb, "hugetlb page") if hugetlb else
            (_libc.HUGE_PAGE_SIZE, "huge page") if self.huge_pages else (_libc.PAGE_SIZE, "page")
        )  # fmt: skip
        offset, nbytes = checked_range(
            offset, nbytes, data_bytes=self.nbytes, length=self.length, granule=granule, granule_kind=kind,
            what="pool memory",
        )  # fmt: skip
        give_back(self.address, offset, nbytes, shared=False, what="pool memory")

    def keep_forever(self) -> None:
        """Never unmap: part of this memory may still be registered with the runtime."""
        with _kept_lock:
            _KEPT_FOREVER.append(self)

    @property
    def unmapped(self) -> bool:
        return not self._finalizer.alive


@dataclass(frozen=True, slots=True)
class _Alias:
    """What pinning a caller's tensor needs beyond the alias tensor itself (see :func:`alias_of`)."""

    owner: weakref.ref[torch.Tensor]  # the caller's tensor, weakly: pinning must not keep it alive
    original: torch.UntypedStorage  # the caller's storage (the alias's buffer holds it too)
    storage: torch.UntypedStorage  # the alias's storage: non-resizable, over the same bytes
    address: int  # where the original storage's bytes were when aliased
    nbytes: int
    storage_offset: int  # bytes from the storage's start to the tensor's
    geometry: _Geometry  # the caller's tensor's (offset, sizes, strides) when pinned


_ALIAS_ATTRIBUTE = "_pinpool_alias"
# A tensor's place in its storage: (storage_offset in elements, sizes, strides).
_Geometry = tuple[int, tuple[int, ...], tuple[int, ...]]


def _geometry(tensor: torch.Tensor) -> _Geometry:
    return int(tensor.storage_offset()), tuple(tensor.size()), tuple(tensor.stride())


def alias_of(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over exactly ``tensor``'s bytes whose storage cannot be resized and keeps ``tensor``'s alive,
    so the plan made from it still describes the memory at entry (an alias of an alias: the same original)."""
    info = getattr(tensor, _ALIAS_ATTRIBUTE, None)
    original = info.original if isinstance(info, _Alias) else tensor.untyped_storage()
    buffer = owned_bytes(original.data_ptr(), original.nbytes(), original)
    storage = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()
    alias = torch.empty(0, dtype=tensor.dtype).set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
    owner = info.owner if isinstance(info, _Alias) else weakref.ref(tensor)
    geometry = info.geometry if isinstance(info, _Alias) else _geometry(tensor)
    offset = int(tensor.storage_offset()) * tensor.element_size()
    record = _Alias(owner, original, storage, original.data_ptr(), original.nbytes(), offset, geometry)
    setattr(alias, _ALIAS_ATTRIBUTE, record)
    return alias


def _point(tensor: torch.Tensor, storage: torch.UntypedStorage, geometry: _Geometry | None = None) -> bool:
    """Point ``tensor`` at ``storage`` with ``geometry`` (default: its own offset, sizes and
    strides); False where torch refuses (sizes beyond the storage, a tensor that cannot change)."""
    offset, size, stride = _geometry(tensor) if geometry is None else geometry
    context = torch.inference_mode() if tensor.is_inference() else torch.no_grad()
    try:
        with context:
            tensor.set_(storage, offset, size, stride)
    except RuntimeError:
        return False
    return True


def _give_back(owner: weakref.ref[torch.Tensor], alias: torch.UntypedStorage, original: torch.UntypedStorage,
               geometry: _Geometry, thread: int) -> None:  # fmt: skip
    """Point the caller's tensor back at its own storage if it still views the alias (as now, else as when
    pinned), in the thread that pointed it at the alias only: another thread may be using it."""
    if threading.get_ident() != thread:
        return
    tensor = owner()
    if tensor is not None and tensor.untyped_storage()._cdata == alias._cdata:
        if not _point(tensor, original):
            _point(tensor, original, geometry)  # where torch refuses this too, it keeps the alias: same bytes


_GiveBack: TypeAlias = "weakref.finalize[..., TensorMemory]"  # gives the caller's tensor its storage back


class TensorMemory:
    """A caller's CPU tensor (the alias :func:`alias_of` made at ``pin()``) as pool memory, never freed:
    bytes ``span`` of it, as HostMapping's. The caller's tensor points at the alias until pinpool lets go."""

    def __init__(self, tensor: torch.Tensor, span: tuple[int, int] | None = None) -> None:
        info = getattr(tensor, _ALIAS_ATTRIBUTE, None)
        if not isinstance(info, _Alias):
            tensor = alias_of(tensor)
            info = getattr(tensor, _ALIAS_ATTRIBUTE)
        assert isinstance(info, _Alias)
        original = info.original
        if original.data_ptr() != info.address or original.nbytes() < info.nbytes:
            raise ConfigError(
                f"pin(tensor): the tensor's storage was reallocated after pin() was called (its bytes moved from "
                f"{info.address:#x}, +{info.nbytes} to {original.data_ptr():#x}, +{original.nbytes()}: a resize_ "
                "that grew it, or a resize of its storage), so the memory this pin was planned for is gone; "
                "nothing was pinned. Call pin() again on the tensor as it is now"
            )
        start, end = (0, tensor.numel() * tensor.element_size()) if span is None else span
        self.tensor = tensor
        self.address = int(tensor.data_ptr()) + start
        self.nbytes = end - start
        self.length = self.nbytes
        self.huge_pages: bool | str = False
        self._storage = info.storage
        self._offset = info.storage_offset + start
        self._finalizer: _GiveBack | None = None
        owner = info.owner()
        if owner is not None and original.resizable() and owner.untyped_storage()._cdata == original._cdata:
            if owner.data_ptr() == tensor.data_ptr() and _point(owner, info.storage):
                self._finalizer = weakref.finalize(
                    self, _give_back, info.owner, info.storage, original, info.geometry, threading.get_ident()
                )
                self._finalizer.atexit = False

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor over ``[offset, offset+nbytes)`` of the pinned bytes (the alias's storage)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"view [{offset}, +{nbytes}) outside the tensor's {self.nbytes} bytes")
        flat = torch.empty(0, dtype=torch.uint8)
        return flat.set_(self._storage, self._offset + offset, (nbytes,), (1,))

    def as_given(self) -> torch.Tensor:
        """The caller's tensor as it was given (dtype, shape, strides) over the pinned bytes."""
        t = self.tensor
        return torch.empty(0, dtype=t.dtype).set_(self._storage, t.storage_offset(), t.size(), t.stride())

    def give_back(self, offset: int, nbytes: int) -> None:
        """Refused: the bytes are the caller's, and dropping them would zero the caller's data."""
        raise ConfigError(
            f"pin(tensor).give_back(offset={shown(offset)}, nbytes={shown(nbytes)}): the memory is the caller's "
            "tensor, which pinpool does not own, so it cannot give its pages back to the host (that would zero "
            "the caller's data); it can still unpin them. Free the tensor yourself once unpinned, or let the pool "
            "own its memory (PinnedPool, or memory=SharedMemory(...)) to give memory back"
        )

    def keep_forever(self) -> None:
        """Never free: part of this memory may still be registered (the caller's tensor keeps the alias)."""
        if self._finalizer is not None:
            self._finalizer.detach()
        with _kept_lock:
            _KEPT_FOREVER.append(self)  # type: ignore[arg-type]

    @property
    def unmapped(self) -> bool:
        return False
