"""Placement: where a pool's buffers sit in its one mapping, and how many bytes it maps.

The one computation that both the pre-flight (:mod:`pinpool._plan.preflight`: does the mapping fit
the address space, the hugetlb pool, the memory?) and the planner (:mod:`pinpool._plan.plan`: chunk
offsets are relative to the mapping) need, so it is made once per pool and passed along. Pure
arithmetic over the options (whose buffers :class:`pinpool._plan.options.PoolOptions` validated
once) and the host's page sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._units import hugetlb_page_size

if TYPE_CHECKING:  # types only: the pre-flight, and with it pinpool doctor, stays torch-free
    from .._host.facts import HostFacts
    from ..layouts import BufferSpec
    from .options import PoolOptions

__all__ = ["Placement", "place"]


@dataclass(frozen=True)
class Placement:
    """The pool's buffers and their offsets in the mapping. Sizes are bytes.

    num_pages: layout pages the pool holds. specs: the layout's buffers for them. offsets: each
    buffer's start in the mapping, aligned to ``align`` (the OS page, or the huge page with
    huge_pages). nbytes: the bytes of all buffers. mapping_bytes: the bytes to map (every buffer,
    each rounded up to ``align``; at least one OS page).
    """

    num_pages: int
    specs: tuple[BufferSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int
    align: int
    mapping_bytes: int


def place(options: PoolOptions, host: HostFacts) -> Placement:
    """Lay the options' buffers out in one mapping on ``host`` (its page sizes). Checks nothing:
    :func:`pinpool._plan.preflight.placement_checks` judges the result against the host."""
    specs = options.buffers
    # hugetlb pages: the mapping's page (2 MiB or 1 GiB); THP: 2 MiB-aligned 4 KiB pages.
    align = hugetlb_page_size(options.huge_pages) or (host.huge_page_size if options.huge_pages else host.page_size)
    offsets: list[int] = []
    offset = 0
    for spec in specs:
        offsets.append(offset)
        offset += -(-spec.nbytes // align) * align
    return Placement(
        num_pages=options.size // options.layout.page_bytes, specs=specs, offsets=tuple(offsets),
        nbytes=sum(spec.nbytes for spec in specs), align=align, mapping_bytes=max(offset, host.page_size),
    )  # fmt: skip
