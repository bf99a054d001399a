"""``pin(tensor)``: a caller's tensor pinned like a pool; ``empty()``: a tensor whose memory starts on a page."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Unpack

import torch
from prometheus_client import REGISTRY

from .. import _probe
from .._errors import ConfigError
from .._host.mapping import HostMapping, alias_of
from .._plan.declared import OPTIONS, keyword_signature
from .._plan.preflight import check_huge_pages
from .._units import hugetlb_page_size
from .pool import PinnedPool
from .request import PinArguments, pool_request


def pin(tensor: torch.Tensor, **options: Unpack[PinArguments]) -> PinnedPool:
    """Pin a CPU tensor you allocated, with PinnedPool's chunking and guarantees: ``with pin(t) as pinned:``
    (or ``async with``). It takes :class:`PinnedPool`'s options but those the tensor decides (``name``
    defaults to ``"tensor"``); its pages are its rows; pinpool never frees its memory. How chunks meet
    OS pages, ``ranges=`` and strided views: docs/concepts.md, "Pinning memory you already own"."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"pin(tensor={type(tensor).__name__}): expected a torch.Tensor")
    if tensor.device.type != "cpu":
        raise ConfigError(f"pin(tensor on {tensor.device}): only CPU tensors live in host memory")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        raise ConfigError("pin(tensor): the tensor has no elements, so there is nothing to pin")
    # An alias of the tensor: the same bytes, whose address and size nothing done to `tensor` can change.
    request = pool_request("pin", options, source=alias_of(tensor))
    pool = PinnedPool.__new__(PinnedPool)
    pool._build(request)
    return pool


# For help() and inspect: every keyword pin() takes, with its default.
pin.__signature__ = keyword_signature(  # type: ignore[attr-defined]
    ["tensor"], (o for o in OPTIONS if o.pin), "PinnedPool", for_pin=True, registry=REGISTRY
)


def _shape(size: tuple[int | Sequence[int], ...]) -> tuple[int, ...]:
    """``empty(2, 3)`` and ``empty((2, 3))`` alike, as torch.empty takes them."""
    dims: object = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
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
    *size: int | Sequence[int], dtype: torch.dtype | None = None, huge_pages: bool | str = False,
    numa_node: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """A new CPU tensor of ``size`` whose memory starts on an OS page, for :func:`pinpool.pin`: like
    ``torch.empty(*size, dtype=dtype)`` over a zero-filled ``mmap`` of its own (``MADV_DONTFORK``; ``huge_pages``
    and ``numa_node`` as a pool's), unmapped with its last view. :class:`pinpool.AllocationError` if the OS refuses."""
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
    if huge_pages:  # the host as it is now: THP enabled, hugetlb pages free
        check_huge_pages(huge_pages, nbytes, _probe.probe_host(torch_build=False))
    mapping = HostMapping(nbytes, huge_pages=huge_pages, numa_node=numa_node)
    # The view's storage holds a buffer object that holds the mapping: unmapped with the last view.
    return mapping.view(0, nbytes).view(dtype).view(shape)
