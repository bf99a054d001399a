"""Dense: any C-contiguous host tensor as a layout, so an engine's own host-pool shape is a pinpool
layout without reshaping a byte pool by hand. Private: ``pinpool.layouts`` re-exports it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .._errors import ConfigError
from .._units import shown
from .spec import BufferSpec, check_dtype

__all__ = ["Dense"]


@dataclass(frozen=True)
class Dense:
    """One C-contiguous buffer of any ``shape`` and ``dtype``, paged along ``page_dim``.

    ``shape`` is the tensor of a one-page pool; a pool of ``n`` pages has ``shape[page_dim] * n``
    along ``page_dim`` and the other dimensions as given. So SGLang's page_first MHA host
    buffer ``(2, size, L, H, D)`` is ``Dense((2, P, L, H, D), torch.bfloat16, page_dim=1,
    granularity_bytes=P*L*H*D*2)``, and a 1-D byte arena of 2 MiB blocks is
    ``Dense((2 << 20,), torch.uint8)``.

    ``granularity_bytes``: the copy unit chunk boundaries fall on multiples of, as the engine
    would pass it to its registration (``None``: no constraint, as :class:`Raw`). It must be
    whole elements and either divide one page's contiguous piece (a page is ``prod(shape[:page_dim])``
    pieces, one in each run of the leading dimensions) or, when a page is one piece, be whole
    pages. ``buffer``: the buffer's name, ``pool.tensors[buffer]``.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    page_dim: int = field(default=0, kw_only=True)
    granularity_bytes: int | None = field(default=None, kw_only=True)
    buffer: str = field(default="data", kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _dense_shape(self.shape))
        check_dtype("Dense", self.dtype)
        ndim, dim = len(self.shape), self.page_dim
        if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < ndim:
            raise ConfigError(
                f"Dense(shape={self.shape}, page_dim={dim!r}): page_dim must be an int in [0, {ndim}), the dimension "
                "pages are stacked along (0 for a page-major tensor such as (page_num, ...))"
            )
        if not isinstance(self.buffer, str) or not self.buffer:
            raise ConfigError(f"Dense(buffer={self.buffer!r}): the buffer's name must be a non-empty str")
        self._check_granularity()

    def _check_granularity(self) -> None:
        g, it = self.granularity_bytes, self.dtype.itemsize
        if g is None:
            return
        if isinstance(g, bool) or not isinstance(g, int) or g <= 0:
            raise ConfigError(
                f"Dense(granularity_bytes={shown(g)}): the granularity must be a positive int number of bytes "
                "(the size of one copy page), or None for no alignment constraint"
            )
        piece, runs = self.page_bytes // self.page_runs, self.page_runs
        if g % it == 0 and (piece % g == 0 or (runs == 1 and g % piece == 0)):
            return
        whole = "" if runs > 1 else f", or a multiple of it (whole pages: {piece * 2}, ...)"
        raise ConfigError(
            f"Dense(shape={self.shape}, dtype={self.dtype}, page_dim={self.page_dim}, granularity_bytes={shown(g)}): "
            f"one page is {runs} contiguous piece(s) of {piece} B, so a copy unit of whole {it}-byte elements must "
            f"divide {piece}{whole}; give e.g. granularity_bytes={piece}"
        )

    @property
    def name(self) -> str:
        return "dense"

    @property
    def page_runs(self) -> int:
        """Runs of the leading dimensions: page *i* is the *i*-th equal slice of each."""
        return math.prod(self.shape[: self.page_dim])

    @property
    def page_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        d = self.page_dim
        shape = (*self.shape[:d], self.shape[d] * num_pages, *self.shape[d + 1 :])
        return (BufferSpec(self.buffer, shape, self.dtype, self.granularity_bytes, self.page_runs),)


def _dense_shape(value: object) -> tuple[int, ...]:
    dims = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else None
    if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in dims):
        raise ConfigError(
            f"Dense(shape={value!r}): must be a non-empty tuple of positive ints, the tensor of a one-page pool "
            "(e.g. (2, 64, 32, 8, 128) for SGLang's page_first MHA, paged along page_dim=1)"
        )
    return dims
