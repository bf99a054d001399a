"""Layouts: what a pool's memory holds, and where copy pages begin and end.

A layout turns a number of pages into buffers (name, shape, dtype) and says, per buffer, its
registration granularity: the byte size of one logical copy page. Chunk boundaries are
multiples of it, so no batched copy ever straddles two registrations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from ._errors import ConfigError
from ._units import shown

__all__ = ["MHA", "MLA", "BufferSpec", "Indexer", "Layout", "Mamba", "PagedBytes", "Raw"]


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
                f"Raw(granularity_bytes={shown(g)}): the granularity must be a positive int number of bytes "
                "(the size of one copy page), or None for no alignment constraint"
            )

    @property
    def name(self) -> str:
        return "raw"

    @property
    def page_bytes(self) -> int:
        return 1

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        return (BufferSpec("data", (num_pages * self.page_bytes,), torch.uint8, self.granularity_bytes, 1),)


LAYER_FIRST = "layer_first"
PAGE_FIRST = "page_first"
PAGE_FIRST_DIRECT = "page_first_direct"
PAGE_HEAD = "page_head"


def _choice(family: str, layout: object, allowed: Sequence[str], why: str = "") -> str:
    if not isinstance(layout, str) or layout not in allowed:
        raise ConfigError(
            f"{family}(layout={layout!r}): choose one of {', '.join(map(repr, allowed))}" + (f" ({why})" if why else "")
        )
    return layout


def _dim(family: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{family}({name}={value!r}): must be a positive int")
    return value


def _dtype(family: str, value: object, name: str = "dtype") -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise ConfigError(
            f"{family}({name}={value!r}): must be a torch.dtype such as torch.bfloat16 or torch.float8_e4m3fn"
        )
    return value


def _shape(family: str, name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ConfigError(f"{family}({name}={value!r}): must be a tuple of non-negative ints")
    dims = tuple(value)
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
        raise ConfigError(f"{family}({name}={value!r}): must be a tuple of non-negative ints")
    return dims


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
            _dim("MHA", name, getattr(self, name))
        _dtype("MHA", self.dtype)
        if not isinstance(self.k_only, bool):
            raise ConfigError(f"MHA(k_only={self.k_only!r}): must be True or False")
        if self.v_head_dim is not None:
            _dim("MHA", "v_head_dim", self.v_head_dim)
        if self.k_only and self.v_head_dim is not None:
            raise ConfigError("MHA(k_only=True, v_head_dim=...): a K-only pool has no V; drop one of them")
        if self.k_only:
            _choice("MHA", self.layout, (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT), "K-only pools")
        elif self.asymmetric:
            _choice("MHA", self.layout, (PAGE_FIRST, PAGE_FIRST_DIRECT), "separate K and V buffers (v_head_dim)")
        else:
            _choice("MHA", self.layout, (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT, PAGE_HEAD))

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
        _choice("MLA", self.layout, (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT))
        for name in ("layer_num", "page_size", "kv_cache_dim"):
            _dim("MLA", name, getattr(self, name))
        _dtype("MLA", self.dtype)

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


@dataclass(frozen=True)
class Mamba:
    """Mamba state pool: one slot (page size 1) holds a temporal state and conv states per layer.

    Buffers ``"temporal"`` and ``"conv0"``, ``"conv1"``, ..., each (size, num_mamba_layers, 1,
    *state_shape); granularity per buffer is one slot, prod(shape[1:])*itemsize of that buffer's
    dtype. Zero-element buffers (a zero in a state shape) are allowed and not registered.

    Dtypes, named as in SGLang's ``Mamba2StateDType(conv=..., temporal=...)`` and its host pool's
    ``temporal_dtype`` / ``conv_dtype``: ``temporal_dtype`` is the temporal (SSM) state's,
    ``conv_dtype`` every conv state's; ``dtype`` is the default for whichever is not given
    (``Mamba(L, t, c, torch.bfloat16)`` keeps every state in bf16;
    ``Mamba(L, t, c, temporal_dtype=torch.float32, conv_dtype=torch.bfloat16)`` mixes them).
    After construction ``temporal_dtype`` and ``conv_dtype`` hold the dtypes in use
    (``conv_dtype`` stays ``None`` only for a pool with no conv states and no dtype for them).
    """

    num_mamba_layers: int
    temporal_shape: tuple[int, ...]
    conv_shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype | None = None
    layout: str = field(default=PAGE_FIRST, kw_only=True)
    temporal_dtype: torch.dtype | None = field(default=None, kw_only=True)
    conv_dtype: torch.dtype | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        _choice("Mamba", self.layout, (PAGE_FIRST, PAGE_FIRST_DIRECT))
        _dim("Mamba", "num_mamba_layers", self.num_mamba_layers)
        object.__setattr__(self, "temporal_shape", _shape("Mamba", "temporal_shape", self.temporal_shape))
        if not isinstance(self.conv_shapes, Sequence) or isinstance(self.conv_shapes, str):
            raise ConfigError(f"Mamba(conv_shapes={self.conv_shapes!r}): must be a sequence of shapes")
        convs = tuple(_shape("Mamba", f"conv_shapes[{i}]", c) for i, c in enumerate(self.conv_shapes))
        object.__setattr__(self, "conv_shapes", convs)
        temporal, conv = self._resolve_dtypes()
        object.__setattr__(self, "temporal_dtype", temporal)
        object.__setattr__(self, "conv_dtype", conv)
        if self.page_bytes == 0:
            raise ConfigError("Mamba: every state shape has a zero dimension, so a slot holds no bytes")

    def _resolve_dtypes(self) -> tuple[torch.dtype, torch.dtype | None]:
        """The temporal and conv dtypes in use: each one given, else ``dtype``; every one checked."""
        default = None if self.dtype is None else _dtype("Mamba", self.dtype)
        temporal = default if self.temporal_dtype is None else _dtype("Mamba", self.temporal_dtype, "temporal_dtype")
        conv = default if self.conv_dtype is None else _dtype("Mamba", self.conv_dtype, "conv_dtype")
        if temporal is None and conv is None:
            raise ConfigError(
                "Mamba(dtype=None): give the states' element type, a torch.dtype: dtype= for every state "
                "(e.g. torch.bfloat16), or temporal_dtype= and conv_dtype= for each (e.g. torch.float32 and "
                "torch.bfloat16, as SGLang's Mamba2StateDType(temporal=..., conv=...))"
            )
        if temporal is None:
            raise ConfigError(
                "Mamba(temporal_dtype=None): the temporal state has no dtype; give temporal_dtype= beside conv_dtype= "
                "(a torch.dtype such as torch.float32), or dtype= as the default for every state"
            )
        if conv is None and self.conv_shapes:
            raise ConfigError(
                "Mamba(conv_dtype=None): the conv states have no dtype; give conv_dtype= beside temporal_dtype= "
                "(a torch.dtype such as torch.bfloat16), or dtype= as the default for every state"
            )
        return temporal, conv

    @property
    def name(self) -> str:
        return f"mamba/{self.layout}"

    def _states(self) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        temporal, conv = self.temporal_dtype, self.conv_dtype  # resolved by __post_init__
        assert temporal is not None and (conv is not None or not self.conv_shapes)
        convs = () if conv is None else tuple((f"conv{i}", c, conv) for i, c in enumerate(self.conv_shapes))
        return (("temporal", self.temporal_shape, temporal), *convs)

    @property
    def page_bytes(self) -> int:
        return sum(self.num_mamba_layers * math.prod(shape) * dtype.itemsize for _, shape, dtype in self._states())

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        specs = []
        for name, state, dtype in self._states():
            shape = (num_pages, self.num_mamba_layers, 1, *state)
            slot = math.prod(shape[1:]) * dtype.itemsize
            specs.append(BufferSpec(name, shape, dtype, slot or None, 1))
        return tuple(specs)


@dataclass(frozen=True)
class Indexer:
    """DSA-style sparse-attention indexer cache (uint8): per page, keys plus per-block fp32 scales.

    ``stride = P*(index_head_dim + index_head_dim//quant_block_size*4)`` bytes per page and layer.
    One buffer ``"index"``: layer_first (L, pages, stride), granularity stride (one page of one
    layer); page_first / page_first_direct (pages, L, 1, stride), granularity stride*L.
    """

    layout: str
    layer_num: int
    page_size: int
    index_head_dim: int
    quant_block_size: int

    def __post_init__(self) -> None:
        _choice("Indexer", self.layout, (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT))
        for name in ("layer_num", "page_size", "index_head_dim", "quant_block_size"):
            _dim("Indexer", name, getattr(self, name))
        if self.index_head_dim % self.quant_block_size:
            raise ConfigError(
                f"Indexer(index_head_dim={self.index_head_dim}, quant_block_size={self.quant_block_size}): "
                "index_head_dim must be a multiple of quant_block_size (one fp32 scale per block)"
            )

    @property
    def name(self) -> str:
        return f"indexer/{self.layout}"

    @property
    def stride(self) -> int:
        return self.page_size * (self.index_head_dim + self.index_head_dim // self.quant_block_size * 4)

    @property
    def page_bytes(self) -> int:
        return self.stride * self.layer_num

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        if self.layout == LAYER_FIRST:
            L = self.layer_num
            return (BufferSpec("index", (L, num_pages, self.stride), torch.uint8, self.stride, L),)
        return (BufferSpec("index", (num_pages, self.layer_num, 1, self.stride), torch.uint8, self.page_bytes, 1),)


@dataclass(frozen=True)
class PagedBytes:
    """DeepSeek-V4-style paged (and state) pools of opaque uint8 items, ``item_bytes`` per page and layer.

    layer_first: one buffer per layer, ``"layer0"``..``"layer{L-1}"``, each (pages, item_bytes),
    granularity item_bytes; page_first (pages, L, item_bytes) and page_first_direct
    (pages, L, 1, item_bytes), one buffer ``"data"``, granularity L*item_bytes.
    For a state pool use :meth:`state` (item = ring_size*slot_bytes).
    """

    layout: str
    layer_num: int
    item_bytes: int

    def __post_init__(self) -> None:
        _choice("PagedBytes", self.layout, (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT))
        _dim("PagedBytes", "layer_num", self.layer_num)
        _dim("PagedBytes", "item_bytes", self.item_bytes)

    @classmethod
    def state(cls, layout: str, layer_num: int, ring_size: int, slot_bytes: int) -> PagedBytes:
        """A state pool: one page holds a ring of ``ring_size`` slots of ``slot_bytes``."""
        _dim("PagedBytes.state", "ring_size", ring_size)
        _dim("PagedBytes.state", "slot_bytes", slot_bytes)
        return cls(layout, layer_num, ring_size * slot_bytes)

    @property
    def name(self) -> str:
        return f"paged/{self.layout}"

    @property
    def page_bytes(self) -> int:
        return self.layer_num * self.item_bytes

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        L, item = self.layer_num, self.item_bytes
        if self.layout == LAYER_FIRST:
            return tuple(BufferSpec(f"layer{i}", (num_pages, item), torch.uint8, item, 1) for i in range(L))
        if self.layout == PAGE_FIRST:
            return (BufferSpec("data", (num_pages, L, item), torch.uint8, L * item, 1),)
        return (BufferSpec("data", (num_pages, L, 1, item), torch.uint8, L * item, 1),)
