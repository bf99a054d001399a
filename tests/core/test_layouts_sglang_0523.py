"""SGLang 0.5.23's newer host layouts: MHA ``page_unified`` and MLA ``page_unified`` /
``page_first_kv_split``, against SGLang's own formulas.

The expected values are written out here from SGLang 0.5.23's released source (the wheel's
``sglang/srt/mem_cache/pool_host/``), never read from ``layout.buffers()``:

* ``page_unified.py``, ``PageUnifiedLayout``: ``page_dims(page_num)`` is
  ``(page_num, head_group_num, layer_num, 2, page_size, head_num // head_group_num, head_dim)``
  for MHA and ``(page_num, layer_num, page_size, head_dim)`` for MLA; ``bytes_per_page`` is
  ``head_group_num * layer_num * components * page_size * heads_per_group * head_dim * itemsize``;
  ``chunk_span`` cuts a page at ``head_group * head_group_bytes + start * layer_bytes``.
* ``mha.py``, ``MHATokenToKVPoolHost.init_kv_buffer``: one ``alloc_func(dims, ...)`` of those
  dims with ``registration_granularity_bytes=self.page_unified_layout.bytes_per_page``
  (``head_group_num`` is the constructor's, default 1).
* ``mla.py``, ``MLATokenToKVPoolHost.init_kv_buffer``: ``page_unified`` passes
  ``page_size * layout_dim`` (``layout_dim = kv_cache_dim * itemsize * layer_num``);
  ``page_first_kv_split`` makes separate allocations, none with a granularity:
  ``k_buffer (page_num, L, P, 1, kv_lora_rank)``, ``v_buffer (page_num, L, P, 1,
  qk_rope_head_dim)``, ``index_k_buffer (page_num, num_indexer_layers, P, 1, index_width)`` in the
  KV dtype and ``index_k_scale_buffer (page_num, num_indexer_layers, P, 1, 1)`` in float32; its
  per-layer views are ``kv_buffer.transpose(0, 1)[i]`` (``_initialize_transfer_views``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pinpool
from pinpool import layouts
from pinpool.testing import FakeRuntime

from .test_layouts_kv import (
    ITEMSIZE,
    PROPERTY_SETTINGS,
    Build,
    Expected,
    check_layout_in_pool,
    dims_D,
    dims_L,
    dims_P,
    dtypes,
    expected_per_page,
)

# -- SGLang's PageUnifiedLayout, written out ------------------------------------------------------------


def sglang_page_unified(
    P: int, L: int, H: int, groups: int, D: int, it: int, *, is_mla: bool = False
) -> dict[str, Any]:
    """PageUnifiedLayout's properties (page_unified.py), as SGLang computes them."""
    components = 1 if is_mla else 2
    heads_per_group = H // groups
    group_bytes = heads_per_group * D * it
    layer_bytes = components * P * group_bytes
    head_group_bytes = L * layer_bytes
    return {
        "bytes_per_page": groups * head_group_bytes,
        "layer_bytes": layer_bytes,
        "head_group_bytes": head_group_bytes,
        "page_dims": (lambda n: (n, L, P, D))
        if is_mla
        else (lambda n: (n, groups, L, components, P, heads_per_group, D)),
    }


@pytest.mark.parametrize(
    ("P", "L", "H", "groups", "D", "dtype"),
    [
        (64, 32, 8, 1, 128, torch.bfloat16),  # SGLang's default head_group_num=1
        (64, 32, 8, 2, 128, torch.bfloat16),
        (16, 3, 8, 8, 64, torch.float16),  # one head per group
        (32, 61, 4, 4, 128, torch.float8_e4m3fn),
    ],
)
def test_mha_page_unified_is_sglangs(P: int, L: int, H: int, groups: int, D: int, dtype: torch.dtype) -> None:
    it = ITEMSIZE[dtype]
    sg = sglang_page_unified(P, L, H, groups, D, it)
    mha = layouts.MHA("page_unified", L, P, H, D, dtype, head_group_num=groups)
    (spec,) = mha.buffers(7)  # one alloc_func call: one buffer
    assert spec.name == "kv" and spec.dtype == dtype
    assert spec.shape == sg["page_dims"](7)
    assert spec.granularity == sg["bytes_per_page"]  # registration_granularity_bytes in init_kv_buffer
    assert mha.page_bytes == sg["bytes_per_page"] == 2 * P * L * H * D * it  # get_size_per_token * P
    assert spec.page_runs == 1  # page i is one block
    assert mha.name == "mha/page_unified"


@pytest.mark.parametrize(("P", "L", "C", "dtype"), [(64, 61, 576, torch.bfloat16), (2, 3, 5, torch.float16)])
def test_mla_page_unified_is_sglangs(P: int, L: int, C: int, dtype: torch.dtype) -> None:
    it = ITEMSIZE[dtype]
    sg = sglang_page_unified(P, L, 1, 1, C, it, is_mla=True)
    mla = layouts.MLA("page_unified", L, P, C, dtype)
    (spec,) = mla.buffers(5)
    assert spec.shape == sg["page_dims"](5) == (5, L, P, C)
    assert spec.granularity == P * C * it * L == sg["bytes_per_page"]  # page_size * layout_dim
    assert mla.page_bytes == P * L * C * it


def test_mla_page_first_kv_split_is_sglangs() -> None:
    # DeepSeek-V3-like: kv_lora_rank 512 + qk_rope_head_dim 64 = kv_cache_dim 576, and GLM-5.2-like
    # indexer layers (a subset of all layers) with an fp32 scale mirror.
    P, L, rank, rope, Li, width = 64, 4, 512, 64, 2, 128
    mla = layouts.MLA(
        "page_first_kv_split", L, P, rank + rope, torch.bfloat16,
        qk_rope_head_dim=rope, index_layer_num=Li, index_head_dim=width, index_scales=True,
    )  # fmt: skip
    specs = mla.buffers(9)
    assert [(s.name, s.shape, s.dtype) for s in specs] == [
        ("k", (9, L, P, 1, rank), torch.bfloat16),
        ("v", (9, L, P, 1, rope), torch.bfloat16),
        ("index_k", (9, Li, P, 1, width), torch.bfloat16),
        ("index_k_scale", (9, Li, P, 1, 1), torch.float32),
    ]
    # SGLang registers each whole; pinpool keeps one page of each buffer inside one registration.
    assert [s.granularity for s in specs] == [P * L * rank * 2, P * L * rope * 2, P * Li * width * 2, P * Li * 4]
    # The memfabric reserve SGLang sizes for the same allocations (total_bytes in init_kv_buffer), per page.
    total = P * L * (rank + rope) * 2 + P * Li * width * 2 + P * Li * 4
    assert mla.page_bytes == total
    assert sum(s.nbytes for s in specs) == 9 * total
    # Without the indexer: two buffers, as without native.index_k.
    plain = layouts.MLA("page_first_kv_split", L, P, rank + rope, torch.bfloat16, qk_rope_head_dim=rope)
    assert [s.name for s in plain.buffers(1)] == ["k", "v"]
    assert plain.page_bytes == P * L * (rank + rope) * 2


def test_kv_split_per_layer_views_are_sglangs_on_the_pool(fake: FakeRuntime) -> None:
    """SGLang's data_refs (``k_buffer.transpose(0, 1)[i]``) and get_contiguous_buf_infos' lengths on
    the pool's own tensors: same strides as a torch.empty of the shape, no copy."""
    P, L, rank, rope = 4, 3, 32, 16
    mla = layouts.MLA("page_first_kv_split", L, P, rank + rope, torch.float16, qk_rope_head_dim=rope)
    with pinpool.PinnedPool(layout=mla, num_pages=50, runtime=fake) as pool:
        k, v = pool.tensors["k"], pool.tensors["v"]
        assert k.stride() == torch.empty(50, L, P, 1, rank).stride()
        refs = [k.transpose(0, 1)[i] for i in range(L)]
        assert all(r.data_ptr() == k.data_ptr() + i * P * rank * 2 for i, r in enumerate(refs))
        assert [r.nbytes for r in refs] == [50 * P * rank * 2] * L
        assert v.data_ptr() >= k.data_ptr() + k.nbytes
        with pytest.raises(pinpool.PoolStateError):
            _ = pool.tensor  # several buffers, as SGLang's several allocations


# -- the pool: shapes, granularity, no straddle (the property of test_layouts_kv) -------------------------


@st.composite
def page_unified_case(draw: st.DrawFn) -> Build:
    L, P, D, dtype = draw(dims_L), draw(dims_P), draw(dims_D), draw(dtypes)
    groups = draw(st.integers(1, 3))
    H = groups * draw(st.integers(1, 3))
    obj = layouts.MHA("page_unified", L, P, H, D, dtype, head_group_num=groups)
    sg = sglang_page_unified(P, L, H, groups, D, ITEMSIZE[dtype])

    def build(n: int) -> list[Expected]:
        def granules(t: torch.Tensor) -> Iterator[torch.Tensor]:
            for page in range(n):
                yield t[page]

        def cells(t: torch.Tensor) -> Iterator[torch.Tensor]:  # chunk_span's (head group, layer) cells
            for page in range(n):
                for g in range(groups):
                    for layer in range(L):
                        assert t[page, g, layer].nbytes == sg["layer_bytes"]
                        yield t[page, g, layer]

        shape = sg["page_dims"](n)
        return [Expected("kv", shape, dtype, sg["bytes_per_page"], granules, 1 + groups * L, cells)]

    return obj, build


@st.composite
def mla_new_case(draw: st.DrawFn, layout: str) -> Build:
    L, P, C, dtype = draw(dims_L), draw(dims_P), draw(st.integers(2, 96)), draw(dtypes)
    if layout == "page_unified":
        obj = layouts.MLA(layout, L, P, C, dtype)
        return obj, lambda n: [expected_per_page("kv", (n, L, P, C), dtype, n)]
    rope = draw(st.integers(1, C - 1))
    index = draw(st.sampled_from([None, (draw(st.integers(1, 3)), draw(st.integers(1, 64)))]))
    scales = index is not None and draw(st.booleans())
    Li, width = index or (None, None)
    obj = layouts.MLA(layout, L, P, C, dtype, qk_rope_head_dim=rope, index_layer_num=Li, index_head_dim=width,
                      index_scales=scales)  # fmt: skip

    def build(n: int) -> list[Expected]:
        out = [expected_per_page("k", (n, L, P, 1, C - rope), dtype, n),
               expected_per_page("v", (n, L, P, 1, rope), dtype, n)]  # fmt: skip
        if Li is not None:
            assert width is not None
            out.append(expected_per_page("index_k", (n, Li, P, 1, width), dtype, n))
            if scales:
                out.append(expected_per_page("index_k_scale", (n, Li, P, 1, 1), torch.float32, n))
        return out

    return obj, build


@pytest.mark.parametrize("case", ["mha/page_unified", "mla/page_unified", "mla/page_first_kv_split"])
@PROPERTY_SETTINGS
@given(data=st.data())
def test_new_layouts_shapes_granularity_and_no_straddle(case: str, data: st.DataObject) -> None:
    strategy = page_unified_case() if case == "mha/page_unified" else mla_new_case(case.split("/")[1])
    check_layout_in_pool(data.draw(strategy, label="layout"), data)


# -- validation -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: layouts.MHA("page_unified", 2, 4, 8, 16, torch.bfloat16, head_group_num=3),
         "MHA(head_num=8, head_group_num=3): head_group_num must divide head_num (each group holds head_num // "
         "head_group_num whole kv heads); give a divisor of 8 such as 1, 2, 4, 8"),
        (lambda: layouts.MHA("page_first", 2, 4, 8, 16, torch.bfloat16, head_group_num=2),
         "MHA(layout='page_first', head_group_num=2): only page_unified cuts a page into head groups; give "
         "layout='page_unified', or drop head_group_num"),
        (lambda: layouts.MHA("page_unified", 2, 4, 8, 16, torch.bfloat16, head_group_num=0),
         "MHA(head_group_num=0): must be a positive int"),
        (lambda: layouts.MHA("page_unified", 2, 4, 8, 16, torch.bfloat16, head_group_num=True),
         "MHA(head_group_num=True): must be a positive int"),
        (lambda: layouts.MHA("page_unified", 2, 4, 8, 16, torch.bfloat16, k_only=True),
         "MHA(layout='page_unified'): choose one of 'layer_first', 'page_first', 'page_first_direct' (K-only pools)"),
        (lambda: layouts.MHA("page_unified", 2, 4, 8, 16, torch.bfloat16, v_head_dim=8),
         "MHA(layout='page_unified'): choose one of 'page_first', 'page_first_direct' (separate K and V buffers"),
        (lambda: layouts.MLA("page_first_kv_split", 2, 4, 576, torch.bfloat16),
         "MLA(layout='page_first_kv_split', kv_cache_dim=576, qk_rope_head_dim=None): give qk_rope_head_dim, the "
         "V buffer's width"),
        (lambda: layouts.MLA("page_first_kv_split", 2, 4, 64, torch.bfloat16, qk_rope_head_dim=64),
         "qk_rope_head_dim=64): give qk_rope_head_dim, the V buffer's width (SGLang's qk_rope_head_dim, e.g. 64), "
         "below kv_cache_dim"),
        (lambda: layouts.MLA("page_first_kv_split", 2, 4, 576, torch.bfloat16, qk_rope_head_dim=64,
                             index_layer_num=2),
         "MLA(index_layer_num=2, index_head_dim=None): an indexer buffer needs both"),
        (lambda: layouts.MLA("page_first_kv_split", 2, 4, 576, torch.bfloat16, qk_rope_head_dim=64,
                             index_scales=True),
         "MLA(index_scales=True): the fp32 scales belong to an indexer buffer"),
        (lambda: layouts.MLA("page_first_kv_split", 2, 4, 576, torch.bfloat16, qk_rope_head_dim=64,
                             index_scales=1),  # type: ignore[arg-type]
         "MLA(index_scales=1): must be True or False"),
        (lambda: layouts.MLA("page_first_kv_split", 2, 4, 576, torch.bfloat16, qk_rope_head_dim=0),
         "MLA(qk_rope_head_dim=0): must be a positive int"),
        (lambda: layouts.MLA("page_first", 2, 4, 576, torch.bfloat16, qk_rope_head_dim=64, index_scales=True),
         "MLA(layout='page_first', qk_rope_head_dim=64, index_scales=True): these describe page_first_kv_split's "
         "separate buffers; give layout='page_first_kv_split', or drop them"),
    ],
)  # fmt: skip
def test_new_layouts_refuse_bad_input(make: object, message: str) -> None:
    with pytest.raises(pinpool.ConfigError) as info:
        make()  # type: ignore[operator]
    assert message in str(info.value)


def test_a_huge_head_num_is_refused_at_once() -> None:
    with pytest.raises(pinpool.ConfigError, match="give a divisor of 1000000007 such as 1"):
        layouts.MHA("page_unified", 1, 1, 1_000_000_007, 16, torch.bfloat16, head_group_num=2)


def test_page_unified_pool_sizes_like_sglang_page_bytes(fake: FakeRuntime) -> None:
    mha = layouts.MHA("page_unified", 32, 64, 8, 128, torch.bfloat16, head_group_num=2)
    pool = pinpool.PinnedPool(layout=mha, size="64MiB", chunk_bytes="16MiB", runtime=fake)
    assert mha.page_bytes == 8 * 2**20
    assert pool.num_pages == 8 and pool.plan.granularity == 8 * 2**20
    assert [c.nbytes for c in pool.plan.chunks] == [16 * 2**20] * 4  # two whole pages per chunk
    assert math.prod(mha.buffers(8)[0].shape) * 2 == 64 * 2**20
