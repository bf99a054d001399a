"""A page-aligned allocator for buffers you will pin with :func:`pinpool.pin`.

torch's CPU allocator returns memory 64 bytes into an OS page (for any size of 128 KiB or
more), so the chunks of a pinned tensor cannot all start on a page: on runtimes that track
exact byte ranges (CUDA, mlock) neighbouring chunks then share a page, and on the others
(ROCm, a runtime that declares nothing) a tensor needing several chunks cannot be pinned at
all. :func:`empty` maps the memory itself, so it starts on a page and pins exactly as a
:class:`pinpool.PinnedPool`'s own memory does.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from .._errors import ConfigError
from .._host.mapping import HostMapping
from .._units import hugetlb_page_size

__all__ = ["empty"]


def _shape(size: tuple[int | Sequence[int], ...]) -> tuple[int, ...]:
    """``empty(2, 3)`` and ``empty((2, 3))`` alike, as torch.empty takes them."""
    dims: object = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
    if isinstance(dims, torch.Size):
        return tuple(dims)
    if not isinstance(dims, Sequence) or isinstance(dims, str | bytes):
        raise ConfigError(f"empty(size={dims!r}): give the sizes as ints, or one sequence of ints")
    shape: list[int] = []
    for dim in dims:
        if isinstance(dim, bool):
            raise ConfigError(f"empty(size={tuple(dims)!r}): {dim!r} is not a size")
        try:
            value = operator.index(dim)
        except TypeError:
            raise ConfigError(f"empty(size={tuple(dims)!r}): {dim!r} is not an int") from None
        if value < 0:
            raise ConfigError(f"empty(size={tuple(dims)!r}): sizes must be >= 0, not {value}")
        shape.append(value)
    return tuple(shape)


def empty(
    *size: int | Sequence[int],
    dtype: torch.dtype | None = None,
    huge_pages: bool | str = False,
    numa_node: int | None = None,
) -> torch.Tensor:
    """A new CPU tensor of ``size`` whose memory starts on an OS page, for :func:`pinpool.pin`.

    Like ``torch.empty(*size, dtype=dtype)`` (``dtype`` defaults to torch's default dtype, and
    the size is given as ints or as one sequence), but the memory is a private anonymous
    ``mmap`` of its own: page-aligned (huge-page-aligned with ``huge_pages``), zero-filled by the
    kernel, faulted in only as it is touched (or as ``pin()`` pre-faults it), and unmapped once
    the tensor and every view of it are gone. Pinning it plans exactly as a ``PinnedPool``'s
    own memory does: every chunk boundary on a page, none shared.

    ``huge_pages``: ``True`` advises transparent huge pages, ``"hugetlb"`` (or ``"hugetlb:2MiB"``)
    maps reserved 2 MiB pages, ``"hugetlb:1GiB"`` reserved 1 GiB pages. ``numa_node``: bind the
    memory to that NUMA node before any of it is faulted. Both as for :class:`pinpool.PinnedPool`.
    Its storage cannot be resized (``resize_`` to a larger size raises), as for any tensor over
    memory torch did not allocate.

    Like a pool's memory, the mapping is ``MADV_DONTFORK``: a child forked while the tensor
    exists has nothing mapped at its address (touching it there is a segmentation fault), so
    the parent's pages are never shared copy-on-write with the child.

    Raises :class:`pinpool.ConfigError` for a bad size, dtype or option, and
    :class:`pinpool.AllocationError` (a ``MemoryError``) where the OS refuses the mapping.
    """
    shape = _shape(size)
    if dtype is None:
        dtype = torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"empty(dtype={dtype!r}): expected a torch.dtype, such as torch.uint8")
    if not (isinstance(huge_pages, bool) or hugetlb_page_size(huge_pages)):
        raise ConfigError(
            f"empty(huge_pages={huge_pages!r}): use False, True (transparent), 'hugetlb' (2 MiB pages; also "
            "'hugetlb:2MiB') or 'hugetlb:1GiB'"
        )
    if numa_node is not None and (isinstance(numa_node, bool) or not isinstance(numa_node, int) or numa_node < 0):
        raise ConfigError(f"empty(numa_node={numa_node!r}): give a NUMA node number (>= 0), or None")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)  # nothing to map, and nothing to pin
    mapping = HostMapping(nbytes, huge_pages=huge_pages, numa_node=numa_node)
    # The view's storage holds a buffer object that holds the mapping: unmapped with the last view.
    return mapping.view(0, nbytes).view(dtype).view(shape)
