"""What a layout is: the Layout protocol, one buffer's BufferSpec, and the checks every family's
constructor shares (so each family's ConfigError names its field and the fix the same way).

Private: ``pinpool.layouts`` is the public module and re-exports these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ._errors import ConfigError


@dataclass(frozen=True)
class BufferSpec:
    """One buffer of a pool: its tensor ``shape`` and ``dtype``, and its ``granularity`` in bytes
    (``None``: any page-aligned split is safe).

    ``page_runs`` says where page *i* lives, so a pool pinning in the background can say which
    leading pages ``[0, k)`` are usable: the buffer is ``page_runs`` equal runs back to back,
    and in each run page *i* is the *i*-th equal slice (1 for page-major shapes such as
    ``(pages, ...)``, ``layer_num`` for layer_first shapes, 2 more-fold for a combined K/V
    buffer). ``None`` (a custom layout that does not say): the buffer's pages are usable only
    once all of it is pinned.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    granularity: int | None
    page_runs: int | None = None

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


LAYER_FIRST = "layer_first"
PAGE_FIRST = "page_first"
PAGE_FIRST_DIRECT = "page_first_direct"
PAGE_HEAD = "page_head"
PAGE_UNIFIED = "page_unified"  # SGLang 0.5.23: a page is one block, head groups outermost
PAGE_FIRST_KV_SPLIT = "page_first_kv_split"  # SGLang 0.5.23 MLA (Ascend): K, V (and indexer) buffers


def check_choice(family: str, layout: object, allowed: Sequence[str], why: str = "") -> str:
    if not isinstance(layout, str) or layout not in allowed:
        raise ConfigError(
            f"{family}(layout={layout!r}): choose one of {', '.join(map(repr, allowed))}" + (f" ({why})" if why else "")
        )
    return layout


def check_dim(family: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{family}({name}={value!r}): must be a positive int")
    return value


def check_dtype(family: str, value: object, name: str = "dtype") -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise ConfigError(
            f"{family}({name}={value!r}): must be a torch.dtype such as torch.bfloat16 or torch.float8_e4m3fn"
        )
    return value


def check_shape(family: str, name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ConfigError(f"{family}({name}={value!r}): must be a tuple of non-negative ints")
    dims = tuple(value)
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
        raise ConfigError(f"{family}({name}={value!r}): must be a tuple of non-negative ints")
    return dims
