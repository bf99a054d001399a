"""Attention KV layouts, as SGLang's host pools lay them out: MHA (K and V) and MLA (one latent
vector per token). Private: ``pinpool.layouts`` is the public module and re-exports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .._errors import ConfigError
from .spec import (
    LAYER_FIRST,
    PAGE_FIRST,
    PAGE_FIRST_DIRECT,
    PAGE_FIRST_KV_SPLIT,
    PAGE_HEAD,
    PAGE_UNIFIED,
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
    page_unified          (page_num, hg, L, 2, P,     2*P*L*H*D*it (one page)
                          H/hg, D)
    ====================  ==========================  ==========================

    ``page_unified`` (SGLang 0.5.23's ``PageUnifiedLayout``) keeps a page in one block with
    its ``head_group_num`` (``hg``) kv-head groups outermost, so a (head group, layer range)
    of a page is one byte run; ``head_num`` must be a multiple of ``head_group_num``.
    """

    layout: str
    layer_num: int
    page_size: int
    head_num: int
    head_dim: int
    dtype: torch.dtype
    k_only: bool = field(default=False, kw_only=True)
    v_head_dim: int | None = field(default=None, kw_only=True)
    head_group_num: int = field(default=1, kw_only=True)

    def __post_init__(self) -> None:
        for name in ("layer_num", "page_size", "head_num", "head_dim", "head_group_num"):
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
            check_choice("MHA", self.layout, (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT, PAGE_HEAD, PAGE_UNIFIED))
        self._check_head_groups()

    def _check_head_groups(self) -> None:
        """SGLang's PageUnifiedLayout: the page is cut into head_group_num groups of whole heads."""
        groups, heads = self.head_group_num, self.head_num
        if groups != 1 and self.layout != PAGE_UNIFIED:
            raise ConfigError(
                f"MHA(layout={self.layout!r}, head_group_num={groups}): only page_unified cuts a page into head "
                "groups; give layout='page_unified', or drop head_group_num"
            )
        if heads % groups:
            some = [d for d in range(1, min(heads, 1024) + 1) if heads % d == 0]  # a real head_num is small
            raise ConfigError(
                f"MHA(head_num={heads}, head_group_num={groups}): head_group_num must divide head_num (each group "
                f"holds head_num // head_group_num whole kv heads); give a divisor of {heads} such as "
                f"{', '.join(map(str, some[-4:]))}"
            )

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
        if self.layout == PAGE_UNIFIED:  # one block per page: (head group, layer, K/V, token, head, dim)
            L, P, H, D, groups = self.layer_num, self.page_size, self.head_num, self.head_dim, self.head_group_num
            shape = (num_pages, groups, L, 2, P, H // groups, D)
            return (BufferSpec("kv", shape, self.dtype, self.page_bytes, 1),)
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
    page_first (size, L, 1, kv_cache_dim), page_first_direct (page_num, L, P, 1, kv_cache_dim)
    and page_unified (page_num, L, P, kv_cache_dim), granularity P*kv_cache_dim*it*L.

    page_first_kv_split (SGLang's Ascend layout) splits the row into buffers ``"k"``
    (page_num, L, P, 1, kv_cache_dim - qk_rope_head_dim) and ``"v"`` (page_num, L, P, 1,
    qk_rope_head_dim); with ``index_layer_num`` and ``index_head_dim`` an ``"index_k"`` buffer
    (page_num, index_layer_num, P, 1, index_head_dim) follows, and with ``index_scales`` an fp32
    ``"index_k_scale"`` (page_num, index_layer_num, P, 1, 1). Each buffer's granularity is one
    page of it (SGLang registers each whole).
    """

    layout: str
    layer_num: int
    page_size: int
    kv_cache_dim: int
    dtype: torch.dtype
    qk_rope_head_dim: int | None = field(default=None, kw_only=True)
    index_layer_num: int | None = field(default=None, kw_only=True)
    index_head_dim: int | None = field(default=None, kw_only=True)
    index_scales: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        check_choice(
            "MLA", self.layout, (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT, PAGE_UNIFIED, PAGE_FIRST_KV_SPLIT)
        )
        for name in ("layer_num", "page_size", "kv_cache_dim"):
            check_dim("MLA", name, getattr(self, name))
        check_dtype("MLA", self.dtype)
        for name in ("qk_rope_head_dim", "index_layer_num", "index_head_dim"):
            if getattr(self, name) is not None:
                check_dim("MLA", name, getattr(self, name))
        if not isinstance(self.index_scales, bool):
            raise ConfigError(f"MLA(index_scales={self.index_scales!r}): must be True or False")
        if self.layout == PAGE_FIRST_KV_SPLIT:
            self._check_split()
        else:
            given = [f"{n}={getattr(self, n)!r}" for n in _SPLIT_FIELDS if getattr(self, n) not in (None, False)]
            if given:
                raise ConfigError(
                    f"MLA(layout={self.layout!r}, {', '.join(given)}): these describe page_first_kv_split's "
                    "separate buffers; give layout='page_first_kv_split', or drop them"
                )

    def _check_split(self) -> None:
        rope, dim = self.qk_rope_head_dim, self.kv_cache_dim
        if rope is None or rope >= dim:
            raise ConfigError(
                f"MLA(layout='page_first_kv_split', kv_cache_dim={dim}, qk_rope_head_dim={rope!r}): give "
                "qk_rope_head_dim, the V buffer's width (SGLang's qk_rope_head_dim, e.g. 64), below kv_cache_dim: "
                "K gets the rest (kv_lora_rank, e.g. 576 - 64 = 512)"
            )
        if (self.index_layer_num is None) != (self.index_head_dim is None):
            raise ConfigError(
                f"MLA(index_layer_num={self.index_layer_num!r}, index_head_dim={self.index_head_dim!r}): an indexer "
                "buffer needs both (its layer count and its width, SGLang's index_width), or neither for none"
            )
        if self.index_scales and self.index_layer_num is None:
            raise ConfigError(
                "MLA(index_scales=True): the fp32 scales belong to an indexer buffer; give index_layer_num and "
                "index_head_dim too, or drop index_scales"
            )

    @property
    def name(self) -> str:
        return f"mla/{self.layout}"

    def _split(self) -> tuple[tuple[str, int, int, torch.dtype], ...]:
        """page_first_kv_split's buffers as (name, layers, width, dtype)."""
        rope, L = self.qk_rope_head_dim, self.layer_num
        assert rope is not None  # checked by __post_init__
        parts = [("k", L, self.kv_cache_dim - rope, self.dtype), ("v", L, rope, self.dtype)]
        if self.index_layer_num is not None and self.index_head_dim is not None:
            parts.append(("index_k", self.index_layer_num, self.index_head_dim, self.dtype))
            if self.index_scales:
                parts.append(("index_k_scale", self.index_layer_num, 1, torch.float32))
        return tuple(parts)

    @property
    def page_bytes(self) -> int:
        if self.layout == PAGE_FIRST_KV_SPLIT:
            return sum(self.page_size * layers * width * dtype.itemsize for _, layers, width, dtype in self._split())
        return self.page_size * self.layer_num * self.kv_cache_dim * self.dtype.itemsize

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        L, P, C = self.layer_num, self.page_size, self.kv_cache_dim
        token = C * self.dtype.itemsize
        if self.layout == LAYER_FIRST:
            return (BufferSpec("kv", (L, num_pages * P, 1, C), self.dtype, P * token, L),)
        if self.layout == PAGE_FIRST:
            return (BufferSpec("kv", (num_pages * P, L, 1, C), self.dtype, P * token * L, 1),)
        if self.layout == PAGE_UNIFIED:  # page_first_direct's bytes without the head axis
            return (BufferSpec("kv", (num_pages, L, P, C), self.dtype, P * token * L, 1),)
        if self.layout == PAGE_FIRST_KV_SPLIT:
            return tuple(
                BufferSpec(name, (num_pages, layers, P, 1, width), dtype, P * layers * width * dtype.itemsize, 1)
                for name, layers, width, dtype in self._split()
            )
        return (BufferSpec("kv", (num_pages, L, P, 1, C), self.dtype, P * token * L, 1),)


_SPLIT_FIELDS = ("qk_rope_head_dim", "index_layer_num", "index_head_dim", "index_scales")
