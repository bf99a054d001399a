"""Layouts: what a pool's memory holds, and where copy pages begin and end.

A layout turns a number of pages into buffers (name, shape, dtype) and says, per buffer, its
registration granularity: the byte size of one logical copy page. Chunk boundaries are
multiples of it, so no batched copy ever straddles two registrations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ._errors import ConfigError
from ._layouts.attention import MHA, MLA
from ._layouts.spec import (
    LAYER_FIRST,
    PAGE_FIRST,
    PAGE_FIRST_DIRECT,
    BufferSpec,
    Layout,
    check_choice,
    check_dim,
    check_dtype,
    check_layout,
    check_shape,
)
from ._units import shown

__all__ = ["MHA", "MLA", "BufferSpec", "Dense", "Indexer", "Layout", "Mamba", "PagedBytes", "Raw", "check_layout"]

# Defined in private modules; this is where users find them.
for _public in (BufferSpec, Layout, MHA, MLA, check_layout):
    _public.__module__ = __name__


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
        """The temporal and conv dtypes in use: each one given, else ``dtype``; every one checked."""
        default = None if self.dtype is None else check_dtype("Mamba", self.dtype)
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
