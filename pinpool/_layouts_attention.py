"""Attention KV layouts, as SGLang's host pools lay them out: MHA (K and V) and MLA (one latent
vector per token). Private: ``pinpool.layouts`` is the public module and re-exports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ._errors import ConfigError
from ._layout_spec import (
    LAYER_FIRST,
    PAGE_FIRST,
    PAGE_FIRST_DIRECT,
    PAGE_HEAD,
    BufferSpec,
    check_choice,
    check_dim,
    check_dtype,
)

__all__ = ["MHA", "MLA"]


@dataclass(frozen=True)
class MHA:
    """Multi-head attention KV cache, as SGLang's MHA host pool lays it out.

    ``L`` = layer_num, ``P`` = page_size (tokens per page), ``H`` = head_num, ``D`` = head_dim,
    ``it`` = dtype itemsize; ``size`` = num_pages * P tokens. One buffer ``"kv"`` with a
    leading dim of 2 (K then V); ``k_only=True`` gives one buffer ``"k"``; a ``v_head_dim``
    different from ``head_dim`` gives separate ``"k"`` and ``"v"`` buffers (page_first and
    page_first_direct only, as in SGLang).

    ====================  ==========================  ==========================
    layout                shape ("kv")                granularity
    ====================  ==========================  ==========================
    layer_first           (2, L, size, H, D)          P*H*D*it (one page of one layer)
    page_first            (2, size, L, H, D)          P*L*H*D*it (one page, all layers)
    page_first_direct     (2, page_num, L, P, H, D)   P*L*H*D*it
    page_head             (2, page_num, H, P, L, D)   P*L*H*D*it (one page)
    ====================  ==========================  ==========================
    """

    layout: str
    layer_num: int
    page_size: int
    head_num: int
    head_dim: int
    dtype: torch.dtype
    k_only: bool = field(default=False, kw_only=True)
    v_head_dim: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        for name in ("layer_num", "page_size", "head_num", "head_dim"):
            check_dim("MHA", name, getattr(self, name))
        check_dtype("MHA", self.dtype)
        if not isinstance(self.k_only, bool):
            raise ConfigError(f"MHA(k_only={self.k_only!r}): must be True or False")
        if self.v_head_dim is not None:
            check_dim("MHA", "v_head_dim", self.v_head_dim)
        if self.k_only and self.v_head_dim is not None:
            raise ConfigError("MHA(k_only=True, v_head_dim=...): a K-only pool has no V; drop one of them")
        if self.k_only:
            check_choice("MHA", self.layout, (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT), "K-only pools")
        elif self.asymmetric:
            check_choice("MHA", self.layout, (PAGE_FIRST, PAGE_FIRST_DIRECT), "separate K and V buffers (v_head_dim)")
        else:
            check_choice("MHA", self.layout, (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT, PAGE_HEAD))

    @property
    def asymmetric(self) -> bool:
        return self.v_head_dim is not None and self.v_head_dim != self.head_dim

    @property
    def name(self) -> str:
        kind = "mha-k" if self.k_only else "mha-kv" if self.asymmetric else "mha"
        return f"{kind}/{self.layout}"

    def _token_stride(self, head_dim: int) -> int:
        return self.head_num * head_dim * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        per_layer = self._token_stride(self.head_dim)
        if self.k_only:
            kv = per_layer
        elif self.asymmetric:
            assert self.v_head_dim is not None
            kv = per_layer + self._token_stride(self.v_head_dim)
        else:
            kv = 2 * per_layer
        return self.page_size * self.layer_num * kv

    def _one(self, name: str, num_pages: int, head_dim: int, lead: tuple[int, ...]) -> BufferSpec:
        L, P, H, D = self.layer_num, self.page_size, self.head_num, head_dim
        size = num_pages * P
        token_stride = self._token_stride(D)
        shape: tuple[int, ...]
        runs = math.prod(lead)  # a combined K/V buffer is K's pages, then V's
        if self.layout == LAYER_FIRST:
            shape, granularity, runs = (L, size, H, D), P * token_stride, runs * L
        elif self.layout == PAGE_FIRST:
            shape, granularity = (size, L, H, D), P * L * token_stride
        elif self.layout == PAGE_FIRST_DIRECT:
            shape, granularity = (num_pages, L, P, H, D), P * L * token_stride
        else:  # page_head
            shape, granularity = (num_pages, H, P, L, D), P * L * token_stride
        return BufferSpec(name, lead + shape, self.dtype, granularity, runs)

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        if self.k_only:
            return (self._one("k", num_pages, self.head_dim, ()),)
        if self.asymmetric:
            assert self.v_head_dim is not None
            return (self._one("k", num_pages, self.head_dim, ()), self._one("v", num_pages, self.v_head_dim, ()))
        return (self._one("kv", num_pages, self.head_dim, (2,)),)


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (DeepSeek-style) KV cache: one latent vector per token and layer.

    One buffer ``"kv"``: layer_first (L, size, 1, kv_cache_dim), granularity P*kv_cache_dim*it;
    page_first (size, L, 1, kv_cache_dim) and page_first_direct (page_num, L, P, 1, kv_cache_dim),
    granularity P*kv_cache_dim*it*L.
    """

    layout: str
    layer_num: int
    page_size: int
    kv_cache_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        check_choice("MLA", self.layout, (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT))
        for name in ("layer_num", "page_size", "kv_cache_dim"):
            check_dim("MLA", name, getattr(self, name))
        check_dtype("MLA", self.dtype)

    @property
    def name(self) -> str:
        return f"mla/{self.layout}"

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.layer_num * self.kv_cache_dim * self.dtype.itemsize

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        L, P, C = self.layer_num, self.page_size, self.kv_cache_dim
        token = C * self.dtype.itemsize
        if self.layout == LAYER_FIRST:
            return (BufferSpec("kv", (L, num_pages * P, 1, C), self.dtype, P * token, L),)
        if self.layout == PAGE_FIRST:
            return (BufferSpec("kv", (num_pages * P, L, 1, C), self.dtype, P * token * L, 1),)
        return (BufferSpec("kv", (num_pages, L, P, 1, C), self.dtype, P * token * L, 1),)
