"""The layout families (Raw, Dense, Mamba, Indexer, PagedBytes, MHA, MLA); ``pinpool.layouts`` lends them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .._errors import ConfigError
from .._units import shown
from ._spec import (
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
    check_granularity,
    check_shape,
)


@dataclass(frozen=True)
class Raw:
    """A plain byte pool: one uint8 buffer ``"data"`` of exactly ``size`` bytes; chunk boundaries fall on
    multiples of ``granularity_bytes`` (``None``: page-aligned). docs/layouts.md, Raw."""

    granularity_bytes: int | None = None
    name = "raw"
    page_bytes = 1

    def __post_init__(self) -> None:
        check_granularity("Raw", self.granularity_bytes)

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        return (BufferSpec("data", (num_pages * self.page_bytes,), torch.uint8, self.granularity_bytes, 1),)


@dataclass(frozen=True)
class Dense:
    """One C-contiguous buffer ``buffer`` of any ``dtype``, paged along ``page_dim``: ``shape`` is the
    tensor of a one-page pool. docs/layouts.md, Dense."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    page_dim: int = field(default=0, kw_only=True)
    granularity_bytes: int | None = field(default=None, kw_only=True)
    buffer: str = field(default="data", kw_only=True)
    name = "dense"

    def __post_init__(self) -> None:
        dims = tuple(self.shape) if isinstance(self.shape, Sequence) and not isinstance(self.shape, str) else None
        if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in dims):
            raise ConfigError(
                f"Dense(shape={self.shape!r}): must be a non-empty tuple of positive ints, the tensor of a one-page "
                "pool (e.g. (2, 64, 32, 8, 128) for SGLang's page_first MHA, paged along page_dim=1)"
            )
        object.__setattr__(self, "shape", dims)
        object.__setattr__(self, "dtype", check_dtype("Dense", self.dtype))  # a name becomes its torch.dtype
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
        check_granularity("Dense", g)
        if g is None:
            return
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


@dataclass(frozen=True)
class Mamba:
    """Mamba state pool: a slot (page) holds a temporal state and conv states per layer, buffers ``"temporal"``,
    ``"conv0"``, ...; ``temporal_dtype`` and ``conv_dtype`` default to ``dtype`` (docs/layouts.md, Mamba)."""

    num_mamba_layers: int
    temporal_shape: tuple[int, ...]
    conv_shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype | None = None
    layout: str = field(default=PAGE_FIRST, kw_only=True)
    temporal_dtype: torch.dtype | None = field(default=None, kw_only=True)
    conv_dtype: torch.dtype | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        check_choice("Mamba", self.layout, (PAGE_FIRST, PAGE_FIRST_DIRECT))
        check_dim("Mamba", "num_mamba_layers", self.num_mamba_layers)
        object.__setattr__(self, "temporal_shape", check_shape("Mamba", "temporal_shape", self.temporal_shape))
        if not isinstance(self.conv_shapes, Sequence) or isinstance(self.conv_shapes, str):
            raise ConfigError(f"Mamba(conv_shapes={self.conv_shapes!r}): must be a sequence of shapes")
        convs = tuple(check_shape("Mamba", f"conv_shapes[{i}]", c) for i, c in enumerate(self.conv_shapes))
        object.__setattr__(self, "conv_shapes", convs)
        temporal, conv = self._resolve_dtypes()
        object.__setattr__(self, "temporal_dtype", temporal)
        object.__setattr__(self, "conv_dtype", conv)
        if self.page_bytes == 0:
            raise ConfigError("Mamba: every state shape has a zero dimension, so a slot holds no bytes")

    def _resolve_dtypes(self) -> tuple[torch.dtype, torch.dtype | None]:
        default = None if self.dtype is None else check_dtype("Mamba", self.dtype)
        object.__setattr__(self, "dtype", default)
        temporal = (
            default if self.temporal_dtype is None else check_dtype("Mamba", self.temporal_dtype, "temporal_dtype")
        )
        conv = default if self.conv_dtype is None else check_dtype("Mamba", self.conv_dtype, "conv_dtype")
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
    """DSA-style sparse-attention indexer cache (uint8): per page, keys plus per-block fp32 scales,
    in one buffer ``"index"``. docs/layouts.md, Indexer."""

    layout: str
    layer_num: int
    page_size: int
    index_head_dim: int
    quant_block_size: int

    def __post_init__(self) -> None:
        check_choice("Indexer", self.layout, (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT))
        for name in ("layer_num", "page_size", "index_head_dim", "quant_block_size"):
            check_dim("Indexer", name, getattr(self, name))
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
    """DeepSeek-V4-style paged pools of opaque uint8 items, ``item_bytes`` per page and layer; a state
    pool is :meth:`state`. docs/layouts.md, PagedBytes."""

    layout: str
    layer_num: int
    item_bytes: int

    def __post_init__(self) -> None:
        check_choice("PagedBytes", self.layout, (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT))
        check_dim("PagedBytes", "layer_num", self.layer_num)
        check_dim("PagedBytes", "item_bytes", self.item_bytes)

    @classmethod
    def state(cls, layout: str, layer_num: int, ring_size: int, slot_bytes: int) -> PagedBytes:
        """A state pool: one page holds a ring of ``ring_size`` slots of ``slot_bytes``."""
        check_dim("PagedBytes.state", "ring_size", ring_size)
        check_dim("PagedBytes.state", "slot_bytes", slot_bytes)
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


@dataclass(frozen=True)
class MHA:
    """Multi-head attention KV cache, as SGLang's MHA host pool lays it out: buffer ``"kv"`` (K then V), ``"k"``
    if ``k_only``, ``"k"`` and ``"v"`` for another ``v_head_dim``; each layout's shapes: docs/layouts.md, MHA."""

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
        object.__setattr__(self, "dtype", check_dtype("MHA", self.dtype))  # a name becomes its torch.dtype
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

    @property
    def page_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.buffers(1))

    def _one(self, name: str, num_pages: int, head_dim: int, lead: tuple[int, ...]) -> BufferSpec:
        L, P, H, D = self.layer_num, self.page_size, self.head_num, head_dim
        size = num_pages * P
        token_stride = H * D * self.dtype.itemsize
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
            return (BufferSpec("kv", shape, self.dtype, math.prod(shape[1:]) * self.dtype.itemsize, 1),)
        if self.k_only:
            return (self._one("k", num_pages, self.head_dim, ()),)
        if self.asymmetric:
            assert self.v_head_dim is not None
            return (self._one("k", num_pages, self.head_dim, ()), self._one("v", num_pages, self.v_head_dim, ()))
        return (self._one("kv", num_pages, self.head_dim, (2,)),)


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (DeepSeek-style) KV cache: a latent vector per token and layer, in buffer
    ``"kv"``, or ``"k"``, ``"v"`` (and the indexer's) by page_first_kv_split; shapes: docs/layouts.md, MLA."""

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
        object.__setattr__(self, "dtype", check_dtype("MLA", self.dtype))  # a name becomes its torch.dtype
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

    def _split(self) -> tuple[tuple[str, int, int, torch.dtype], ...]:  # (name, layers, width, dtype) each
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
        return sum(spec.nbytes for spec in self.buffers(1))

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
