"""Dense: any host tensor as a layout. Every SGLang host buffer written as a Dense is the same
buffer as pinpool's family for it (shape, dtype, granularity, where page *i* lives); a real
mlock pool's Dense tensor is, byte for byte and stride for stride, the hand reshape of a Raw pool
it replaces; and every bad input is a ConfigError naming the value and the fix."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pinpool
from pinpool import layouts
from pinpool.testing import FakeRuntime, locked_bytes

from ..conftest import needs_mlock
from .test_layouts_kv import PROPERTY_SETTINGS, dims_D, dims_L, dims_P, dtypes


def as_dense(family: Any, P: int, L: int, H: int, D: int, dtype: torch.dtype, g: int) -> layouts.Dense:
    """SGLang's MHA host buffer of each layout (mha.py, MHATokenToKVPoolHost.init_kv_buffer) written as
    a Dense: the one-page tensor and the dimension its pages stack along."""
    it = dtype.itemsize
    granularity = {"layer_first": P * H * D * it, "page_unified": 2 * P * L * H * D * it}.get(
        family, P * L * H * D * it
    )
    one_page, page_dim = {
        "layer_first": ((2, L, P, H, D), 2),  # (2, L, size, H, D)
        "page_first": ((2, P, L, H, D), 1),  # (2, size, L, H, D)
        "page_first_direct": ((2, 1, L, P, H, D), 1),  # (2, page_num, L, P, H, D)
        "page_head": ((2, 1, H, P, L, D), 1),  # (2, page_num, H, P, L, D)
        "page_unified": ((1, g, L, 2, P, H // g, D), 0),  # PageUnifiedLayout.page_dims
    }[family]
    return layouts.Dense(one_page, dtype, page_dim=page_dim, granularity_bytes=granularity, buffer="kv")


@PROPERTY_SETTINGS
@given(
    family=st.sampled_from(["layer_first", "page_first", "page_first_direct", "page_head", "page_unified"]),
    L=dims_L, P=dims_P, D=dims_D, dtype=dtypes, groups=st.integers(1, 3), per_group=st.integers(1, 3),
    num_pages=st.integers(1, 40),
)  # fmt: skip
def test_every_mha_layout_is_a_dense_layout(
    family: str, L: int, P: int, D: int, dtype: torch.dtype, groups: int, per_group: int, num_pages: int
) -> None:
    H = groups * per_group
    g = groups if family == "page_unified" else 1
    mha = layouts.MHA(family, L, P, H, D, dtype, head_group_num=g)
    dense = as_dense(family, P, L, H, D, dtype, g)
    assert dense.page_bytes == mha.page_bytes
    assert dense.buffers(num_pages) == mha.buffers(num_pages)  # name, shape, dtype, granularity, page_runs


def test_other_families_as_dense() -> None:
    """A buffer per family that is not MHA: Mamba's per-slot state, the indexer's layer_first run, a
    DeepSeek-V4 page_first item, MLA page_first_direct with SGLang's 60-byte vector, and Raw."""
    (temporal, conv) = layouts.Mamba(
        2, (4, 8), ((3, 5),), temporal_dtype=torch.float32, conv_dtype=torch.bfloat16
    ).buffers(7)
    assert layouts.Dense((1, 2, 1, 4, 8), torch.float32, granularity_bytes=256, buffer="temporal").buffers(7) == (
        temporal,
    )
    assert layouts.Dense((1, 2, 1, 3, 5), torch.bfloat16, granularity_bytes=60, buffer="conv0").buffers(7) == (conv,)
    (index,) = layouts.Indexer("layer_first", 3, 64, 128, 128).buffers(5)
    assert layouts.Dense((3, 1, 8448), torch.uint8, page_dim=1, granularity_bytes=8448, buffer="index").buffers(5) == (
        index,
    )
    (paged,) = layouts.PagedBytes("page_first", 3, 584).buffers(4)
    assert layouts.Dense((1, 3, 584), torch.uint8, granularity_bytes=3 * 584).buffers(4) == (paged,)
    (mla,) = layouts.MLA("page_first_direct", 3, 2, 5, torch.float16).buffers(9)
    assert layouts.Dense((1, 3, 2, 1, 5), torch.float16, granularity_bytes=60, buffer="kv").buffers(9) == (mla,)
    raw = layouts.Raw(300 << 20)
    assert layouts.Dense((1,), torch.uint8, granularity_bytes=300 << 20).buffers(1000) == raw.buffers(1000)
    assert layouts.Dense((1,), torch.uint8).page_bytes == raw.page_bytes == 1


def test_a_background_pool_of_a_dense_layout_tracks_pages_as_its_family_does() -> None:
    P, L, H, D = 4, 2, 2, 64
    mha = layouts.MHA("page_first", L, P, H, D, torch.bfloat16)
    dense = as_dense("page_first", P, L, H, D, torch.bfloat16, 1)
    plans = [
        pinpool.PinnedPool(layout=lay, num_pages=300, chunk_bytes="256KiB", runtime=FakeRuntime(), background=True)
        for lay in (mha, dense)
    ]
    assert plans[0]._plan.page_runs == plans[1]._plan.page_runs  # K's pages and V's: two runs
    assert len(plans[1]._plan.page_runs) == 2
    assert list(plans[0].plan.chunks) == list(plans[1].plan.chunks)


@needs_mlock
def test_a_real_mlock_pool_of_sglangs_shape_is_the_hand_reshaped_raw_pool(vmlck_baseline: int) -> None:
    """SGLang's page_first MHA host buffer (2, size, L, H, D) bf16, registered at P*layout_dim, as a
    Dense pool: the tensor SGLang allocates, with no reshaping; and the same bytes, strides and chunks
    as the Raw pool an adopter reshaped by hand before."""
    P, L, H, D, pages = 64, 4, 2, 128, 96  # page = 256 KiB, pool = 24 MiB
    it, granularity = 2, P * L * H * D * 2
    dense = layouts.Dense((2, P, L, H, D), torch.bfloat16, page_dim=1, granularity_bytes=granularity, buffer="kv")
    shape = (2, pages * P, L, H, D)
    nbytes = math.prod(shape) * it
    options: dict[str, Any] = {"runtime": "mlock", "registry": None, "chunk_bytes": "4MiB"}
    with (
        pinpool.PinnedPool(layout=dense, num_pages=pages, name="dense", **options) as pool,
        pinpool.PinnedPool(layout=layouts.Raw(granularity), size=nbytes, name="raw", **options) as raw,
    ):
        assert locked_bytes() - vmlck_baseline >= 2 * nbytes  # both really locked
        t = pool.tensor
        assert t is pool.tensors["kv"]
        by_hand = raw.tensor.view(torch.bfloat16).view(shape)  # what the adopter wrote before
        assert t.shape == by_hand.shape == torch.Size(shape)
        assert t.dtype == torch.bfloat16 and t.stride() == by_hand.stride() == torch.empty(shape).stride()
        assert t.data_ptr() == pool.data_ptr and t.nbytes == nbytes == pool.nbytes
        assert [(c.offset, c.nbytes) for c in pool.plan.chunks] == [(c.offset, c.nbytes) for c in raw.plan.chunks]
        data = torch.randn(shape, dtype=torch.float32).to(torch.bfloat16)
        t.copy_(data)
        by_hand.copy_(data)
        assert torch.equal(t.view(torch.uint8).reshape(-1), raw.tensor)  # byte-identical
        # SGLang's per-layer views (page_first: k_buffer.transpose(0, 1)[i]) work on it as they are.
        k_layer = t[0].transpose(0, 1)[3]
        assert k_layer.shape == (pages * P, H, D) and torch.equal(k_layer, data[0, :, 3])
    assert locked_bytes() == vmlck_baseline


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: layouts.Dense((), torch.uint8),
         "Dense(shape=()): must be a non-empty tuple of positive ints, the tensor of a one-page pool"),
        (lambda: layouts.Dense((2, 0, 4), torch.uint8), "Dense(shape=(2, 0, 4)): must be a non-empty tuple"),
        (lambda: layouts.Dense((2, True), torch.uint8), "Dense(shape=(2, True)): must be a non-empty tuple"),
        (lambda: layouts.Dense("2,4", torch.uint8),  # type: ignore[arg-type]
         "Dense(shape='2,4'): must be a non-empty tuple"),
        (lambda: layouts.Dense((2, 4.0), torch.uint8),  # type: ignore[arg-type]
         "Dense(shape=(2, 4.0)): must be a non-empty tuple"),
        (lambda: layouts.Dense((2, 4), "bf17"),  # type: ignore[arg-type]
         "Dense(dtype='bf17'): must be a torch.dtype or its name"),
        (lambda: layouts.Dense((2, 4), torch.uint8, page_dim=2),
         "Dense(shape=(2, 4), page_dim=2): page_dim must be an int in [0, 2)"),
        (lambda: layouts.Dense((2, 4), torch.uint8, page_dim=-1), "page_dim=-1): page_dim must be an int in [0, 2)"),
        (lambda: layouts.Dense((2, 4), torch.uint8, page_dim=True), "page_dim=True): page_dim must be an int"),
        (lambda: layouts.Dense((2, 4), torch.uint8, buffer=""), "Dense(buffer=''): the buffer's name must be"),
        (lambda: layouts.Dense((2, 4), torch.uint8, granularity_bytes=0),
         "Dense(granularity_bytes=0): the granularity must be a positive int number of bytes"),
        (lambda: layouts.Dense((2, 4), torch.uint8, granularity_bytes="4KiB"),  # type: ignore[arg-type]
         "Dense(granularity_bytes='4KiB'): the granularity must be a positive int"),
        # (2, size, 64) bf16: a page is 2 pieces of 128 B; 96 does not divide 128.
        (lambda: layouts.Dense((2, 1, 64), torch.bfloat16, page_dim=1, granularity_bytes=96),
         "Dense(shape=(2, 1, 64), dtype=torch.bfloat16, page_dim=1, granularity_bytes=96): one page is 2 contiguous "
         "piece(s) of 128 B, so a copy unit of whole 2-byte elements must divide 128; give e.g. granularity_bytes=128"),
        # ... nor can a unit span pages there: page i's pieces are not next to each other.
        (lambda: layouts.Dense((2, 1, 64), torch.bfloat16, page_dim=1, granularity_bytes=256),
         "must divide 128; give e.g."),
        # Half an element.
        (lambda: layouts.Dense((64,), torch.float32, granularity_bytes=2),
         "one page is 1 contiguous piece(s) of 256 B, so a copy unit of whole 4-byte elements must divide 256, or a "
         "multiple of it (whole pages: 512, ...); give e.g. granularity_bytes=256"),
        (lambda: layouts.Dense((64,), torch.float32, granularity_bytes=384), "must divide 256, or a multiple of it"),
    ],
)  # fmt: skip
def test_dense_refuses_bad_input(make: Any, message: str) -> None:
    with pytest.raises(pinpool.ConfigError) as info:
        make()
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("dense", "granularity"),
    [
        (layouts.Dense((64,), torch.float32, granularity_bytes=64), 64),  # a unit inside one page
        (layouts.Dense((64,), torch.float32, granularity_bytes=1024), 1024),  # four whole pages (an arena block)
        (layouts.Dense((2, 1, 64), torch.bfloat16, page_dim=1, granularity_bytes=32), 32),
        (layouts.Dense((1, 1, 64), torch.bfloat16, page_dim=2, granularity_bytes=256), 256),  # one piece per page
    ],
)
def test_sensible_granularities_are_accepted_and_chunk_the_pool(
    fake: FakeRuntime, dense: layouts.Dense, granularity: int
) -> None:
    pool = pinpool.PinnedPool(layout=dense, size="1MiB", chunk_bytes="64KiB", runtime=fake)
    assert pool.plan.granularity == granularity
    assert all(c.offset % math.lcm(granularity, 4096) == 0 for c in pool.plan.chunks)
    assert sum(c.nbytes for c in pool.plan.chunks) == pool.nbytes == pool.num_pages * dense.page_bytes


def test_dense_defaults_and_name() -> None:
    dense = layouts.Dense([3, 5], torch.int32)  # type: ignore[arg-type] # a list is taken as the shape
    assert dense.shape == (3, 5) and dense.page_dim == 0 and dense.granularity_bytes is None
    assert dense.buffer == "data" and dense.name == "dense" and dense.page_bytes == 60
    assert dense.buffers(4) == (layouts.BufferSpec("data", (12, 5), torch.int32, None, 1),)
    assert isinstance(dense, layouts.Layout)
