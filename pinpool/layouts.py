"""Layouts: what a pool's memory holds, and where copy pages begin and end.

A layout turns a number of pages into buffers (name, shape, dtype) and says, per buffer, its
registration granularity: the byte size of one logical copy page. Chunk boundaries are
multiples of it, so no batched copy ever straddles two registrations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ._errors import ConfigError

__all__ = ["BufferSpec", "Layout", "Raw"]


@dataclass(frozen=True)
class BufferSpec:
    """One buffer of a pool: its tensor ``shape`` and ``dtype``, and its ``granularity`` in bytes
    (``None``: any page-aligned split is safe)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    granularity: int | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@runtime_checkable
class Layout(Protocol):
    """What PinnedPool asks of a layout."""

    @property
    def name(self) -> str:
        """Short name for logs and metrics labels, e.g. ``"raw"`` or ``"mha/page_first"``."""
        ...

    @property
    def page_bytes(self) -> int:
        """Bytes one page occupies across all buffers; ``size=`` buys whole pages of this."""
        ...

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        """The buffers of a pool holding ``num_pages`` pages."""
        ...


@dataclass(frozen=True)
class Raw:
    """A plain byte pool: one uint8 buffer named ``"data"``.

    ``granularity_bytes``: chunk boundaries fall on multiples of it (the copy-page size of
    whatever you will lay out in it); ``None``, the default, means one registration of the
    whole buffer as long as it fits the chunk limit, page-aligned chunks beyond it.
    The pool holds exactly ``size`` bytes (a byte pool's page is one byte); with a
    granularity the last chunk may end mid-granule, as in the reference plan 900+900+700 MiB.
    """

    granularity_bytes: int | None = None

    def __post_init__(self) -> None:
        g = self.granularity_bytes
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g <= 0):
            raise ConfigError(
                f"Raw(granularity_bytes={g!r}): the granularity must be a positive int number of bytes "
                "(the size of one copy page), or None for no alignment constraint"
            )

    @property
    def name(self) -> str:
        return "raw"

    @property
    def page_bytes(self) -> int:
        return 1

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        return (BufferSpec("data", (num_pages * self.page_bytes,), torch.uint8, self.granularity_bytes),)
