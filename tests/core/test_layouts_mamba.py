"""Mamba state pools whose temporal and conv states have different dtypes (issue 12, item 4).

SGLang's Mamba host pool keeps the temporal (SSM) state in ``temporal_dtype`` and every conv
state in ``conv_dtype`` (``Mamba2StateDType(conv=..., temporal=...)``): fp32 temporal beside
bf16 conv is the common case, and its tests mix fp16 and fp32. Expected sizes are written out
by hand from SGLang's ``get_size_per_token``: ``(sum(conv elems * conv itemsize) + temporal
elems * temporal itemsize) * num_mamba_layers``, never read back from the layout.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pinpool
from pinpool import layouts
from pinpool.testing import FakeRuntime

from ..conftest import config_error

KiB = 1 << 10
MiB = 1 << 20

# Itemsizes written down here, not read from torch, so a wrong dtype shows up as a wrong size.
ITEMSIZE = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float8_e4m3fn: 1}


# -- the reference's vectors -----------------------------------------------------------------------


def test_mixed_fp16_conv_and_fp32_temporal_vector() -> None:
    # SGLang's host-pool test shapes (one Mamba layer, conv (4, 4), temporal (2, 8, 8)), with the
    # temporal state in fp32 and the conv state in fp16.
    mamba = layouts.Mamba(1, (2, 8, 8), ((4, 4),), temporal_dtype=torch.float32, conv_dtype=torch.float16)
    temporal_slot = 1 * 2 * 8 * 8 * 4  # 512 B
    conv_slot = 1 * 4 * 4 * 2  # 32 B
    assert mamba.page_bytes == temporal_slot + conv_slot == 544
    assert (mamba.temporal_dtype, mamba.conv_dtype) == (torch.float32, torch.float16)
    temporal, conv = mamba.buffers(65)
    assert temporal == layouts.BufferSpec("temporal", (65, 1, 1, 2, 8, 8), torch.float32, 512, 1)
    assert conv == layouts.BufferSpec("conv0", (65, 1, 1, 4, 4), torch.float16, 32, 1)
    assert temporal.nbytes == 65 * 512 and conv.nbytes == 65 * 32


def test_fp32_temporal_beside_bf16_conv_vector() -> None:
    # A Qwen3-Next-like linear-attention state per rank: 36 Mamba layers, temporal
    # (heads 32, head_k_dim 128, head_v_dim 128) in fp32, one conv state (conv_dim 8192,
    # kernel - 1 = 3) in bf16.
    mamba = layouts.Mamba(36, (32, 128, 128), ((8192, 3),), temporal_dtype=torch.float32, conv_dtype=torch.bfloat16)
    temporal_slot = 36 * 32 * 128 * 128 * 4  # 72 MiB
    conv_slot = 36 * 8192 * 3 * 2  # 1.6875 MiB
    assert temporal_slot == 72 * MiB and conv_slot == 1_769_472
    assert mamba.page_bytes == temporal_slot + conv_slot
    specs = {s.name: s for s in mamba.buffers(10)}
    assert specs["temporal"].granularity == temporal_slot and specs["temporal"].dtype is torch.float32
    assert specs["conv0"].granularity == conv_slot and specs["conv0"].dtype is torch.bfloat16
    assert [s.page_runs for s in specs.values()] == [1, 1]
    # One dtype for both (what pinpool offered before) would have got every conv slot twice as big.
    single = layouts.Mamba(36, (32, 128, 128), ((8192, 3),), torch.float32)
    assert single.page_bytes - mamba.page_bytes == conv_slot


# -- dtype= stays the default for both -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(ITEMSIZE))
def test_one_dtype_is_the_default_for_every_state(dtype: torch.dtype) -> None:
    old_style = layouts.Mamba(3, (4, 5), ((6,), (0, 2), (2, 3)), dtype)
    explicit = layouts.Mamba(3, (4, 5), ((6,), (0, 2), (2, 3)), temporal_dtype=dtype, conv_dtype=dtype)
    assert old_style.buffers(7) == explicit.buffers(7)
    assert old_style.page_bytes == explicit.page_bytes == 3 * (20 + 6 + 0 + 6) * ITEMSIZE[dtype]
    assert (old_style.dtype, old_style.temporal_dtype, old_style.conv_dtype) == (dtype, dtype, dtype)
    assert all(spec.dtype is dtype for spec in old_style.buffers(7))


def test_dtype_is_the_default_for_the_state_not_given() -> None:
    temporal_only = layouts.Mamba(2, (4,), ((3,),), torch.bfloat16, temporal_dtype=torch.float32)
    assert [(s.name, s.dtype, s.granularity) for s in temporal_only.buffers(5)] == [
        ("temporal", torch.float32, 2 * 4 * 4),
        ("conv0", torch.bfloat16, 2 * 3 * 2),
    ]
    conv_only = layouts.Mamba(2, (4,), ((3,),), torch.bfloat16, conv_dtype=torch.float8_e4m3fn)
    assert [(s.name, s.dtype, s.granularity) for s in conv_only.buffers(5)] == [
        ("temporal", torch.bfloat16, 2 * 4 * 2),
        ("conv0", torch.float8_e4m3fn, 2 * 3 * 1),
    ]
    assert conv_only.page_bytes == 16 + 6


def test_every_conv_state_takes_conv_dtype() -> None:
    mamba = layouts.Mamba(2, (8,), ((3, 4), (5,), (2, 2, 2)), temporal_dtype=torch.float32, conv_dtype=torch.float16)
    assert [s.dtype for s in mamba.buffers(1)] == [torch.float32, torch.float16, torch.float16, torch.float16]
    assert mamba.page_bytes == 2 * 8 * 4 + 2 * (12 + 5 + 8) * 2


def test_no_conv_states_need_no_conv_dtype() -> None:
    mamba = layouts.Mamba(1, (8,), (), temporal_dtype=torch.float32)
    assert mamba.conv_dtype is None
    assert mamba.buffers(4) == (layouts.BufferSpec("temporal", (4, 1, 1, 8), torch.float32, 32, 1),)


def test_a_zero_element_state_in_its_own_dtype_is_not_registered(fake: FakeRuntime) -> None:
    mamba = layouts.Mamba(2, (3, 5), ((0, 4), (6, 3)), temporal_dtype=torch.float32, conv_dtype=torch.bfloat16)
    assert mamba.page_bytes == 2 * 15 * 4 + 2 * 18 * 2
    pool = pinpool.PinnedPool(layout=mamba, num_pages=100, runtime=fake, registry=None)
    buffers = {b.spec.name: b for b in pool._plan.buffers}
    assert buffers["conv0"].spec.granularity is None and buffers["conv0"].chunks == ()
    assert buffers["conv0"].spec.dtype is torch.bfloat16
    assert buffers["conv1"].spec.granularity == 72 and buffers["temporal"].spec.granularity == 120


# -- a pool of such a layout ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("temporal_dtype", "conv_dtype"),
    [(torch.float32, torch.float16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_a_mixed_dtype_pool_pins_with_each_buffer_in_its_dtype(
    fake: FakeRuntime, layout: str, temporal_dtype: torch.dtype, conv_dtype: torch.dtype
) -> None:
    Lm, temporal_shape, conv_shapes = 4, (8, 16, 16), ((96, 3), (32, 3))
    mamba = layouts.Mamba(
        Lm, temporal_shape, conv_shapes, layout=layout, temporal_dtype=temporal_dtype, conv_dtype=conv_dtype
    )
    slots = {
        "temporal": Lm * math.prod(temporal_shape) * ITEMSIZE[temporal_dtype],
        "conv0": Lm * 96 * 3 * ITEMSIZE[conv_dtype],
        "conv1": Lm * 32 * 3 * ITEMSIZE[conv_dtype],
    }
    assert mamba.page_bytes == sum(slots.values())
    num_pages = 200
    with pinpool.PinnedPool(
        layout=mamba, num_pages=num_pages, chunk_bytes=256 * KiB, runtime=fake, registry=None
    ) as pool:
        assert pool.num_pages == num_pages
        assert pool.plan.granularity is None  # the buffers' granularities differ
        tensors = pool.tensors
        assert list(tensors) == ["temporal", "conv0", "conv1"]
        assert tensors["temporal"].dtype is temporal_dtype
        assert tensors["conv0"].dtype is conv_dtype and tensors["conv1"].dtype is conv_dtype
        assert tensors["temporal"].shape == (num_pages, Lm, 1, *temporal_shape)
        assert tensors["conv0"].shape == (num_pages, Lm, 1, 96, 3)
        for name, tensor in tensors.items():
            assert tensor[0].numel() * tensor.element_size() == slots[name]  # one slot is one granule
        # Every chunk of a buffer starts on a slot boundary of that buffer, in its own dtype's bytes.
        for b in pool._plan.buffers:
            assert b.spec.granularity == slots[b.spec.name]
            assert b.chunks and all((c.offset - b.offset) % slots[b.spec.name] == 0 for c in b.chunks)
            assert sum(c.nbytes for c in b.chunks) == b.spec.nbytes
        # Writes through one view land in that buffer only (the views do not overlap).
        tensors["temporal"][-1].fill_(1.5)
        tensors["conv1"][0].fill_(-2)
        assert float(tensors["temporal"][-1].float().sum()) == 1.5 * slots["temporal"] / ITEMSIZE[temporal_dtype]
        assert float(tensors["conv0"].float().abs().sum()) == 0.0
    assert fake.registered == {}


STATE = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)
CONV = st.lists(st.integers(0, 5), min_size=1, max_size=2).map(tuple)  # a 0 makes an empty buffer
DTYPES = st.sampled_from(list(ITEMSIZE))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    Lm=st.integers(1, 6),
    temporal=STATE,
    convs=st.lists(CONV, min_size=0, max_size=3),
    temporal_dtype=DTYPES,
    conv_dtype=DTYPES,
    pages=st.integers(1, 50),
)
def test_each_buffer_is_sized_in_its_own_dtype(
    Lm: int,
    temporal: tuple[int, ...],
    convs: list[tuple[int, ...]],
    temporal_dtype: torch.dtype,
    conv_dtype: torch.dtype,
    pages: int,
) -> None:
    mamba = layouts.Mamba(Lm, temporal, tuple(convs), temporal_dtype=temporal_dtype, conv_dtype=conv_dtype)
    expected = [("temporal", temporal, temporal_dtype), *((f"conv{i}", c, conv_dtype) for i, c in enumerate(convs))]
    specs = mamba.buffers(pages)
    assert [(s.name, s.shape, s.dtype) for s in specs] == [
        (name, (pages, Lm, 1, *shape), dtype) for name, shape, dtype in expected
    ]
    slots = [Lm * math.prod(shape) * ITEMSIZE[dtype] for _, shape, dtype in expected]
    assert [s.granularity for s in specs] == [slot or None for slot in slots]
    assert [s.page_runs for s in specs] == [1] * len(specs)
    assert [s.nbytes for s in specs] == [pages * slot for slot in slots]
    assert mamba.page_bytes == sum(slots)


# -- invalid dtypes -----------------------------------------------------------------------------------------------

BAD_DTYPES = ["float33", "torch.bfloat17", "bf17", "Tensor", "", 4, True, 1.5, torch.tensor(1.0), [torch.float32]]


@pytest.mark.parametrize("bad", BAD_DTYPES, ids=repr)
@pytest.mark.parametrize("field", ["temporal_dtype", "conv_dtype"])
def test_a_state_dtype_must_be_a_torch_dtype(field: str, bad: object) -> None:
    kwargs: dict[str, Any] = {"temporal_dtype": torch.float32, "conv_dtype": torch.bfloat16, field: bad}
    message = config_error(lambda: layouts.Mamba(2, (4,), ((3,),), **kwargs))
    assert message.startswith(f"Mamba({field}={bad!r}): ")
    assert "must be a torch.dtype or its name, such as bfloat16" in message


@pytest.mark.parametrize("bad", BAD_DTYPES, ids=repr)
def test_the_default_dtype_must_be_a_torch_dtype(bad: object) -> None:
    message = config_error(lambda: layouts.Mamba(2, (4,), ((3,),), bad))  # type: ignore[arg-type]
    assert message.startswith(f"Mamba(dtype={bad!r}): ") and "torch.dtype" in message


def test_a_numpy_dtype_is_not_a_state_dtype() -> None:
    numpy = pytest.importorskip("numpy")
    message = config_error(
        lambda: layouts.Mamba(2, (4,), ((3,),), temporal_dtype=numpy.float32, conv_dtype=torch.float16)
    )
    assert "temporal_dtype=" in message and "torch.dtype" in message


def test_no_dtype_at_all_names_every_way_to_give_one() -> None:
    message = config_error(lambda: layouts.Mamba(2, (4,), ((3,),)))
    assert message.startswith("Mamba(dtype=None): ")
    assert "dtype=" in message and "temporal_dtype=" in message and "conv_dtype=" in message
    assert "torch.dtype" in message


def test_conv_states_without_a_dtype_name_conv_dtype() -> None:
    message = config_error(lambda: layouts.Mamba(2, (4,), ((3,),), temporal_dtype=torch.float32))
    assert message.startswith("Mamba(conv_dtype=None): ")
    assert "give conv_dtype=" in message and "or dtype=" in message


def test_a_temporal_state_without_a_dtype_names_temporal_dtype() -> None:
    message = config_error(lambda: layouts.Mamba(2, (4,), ((3,),), conv_dtype=torch.bfloat16))
    assert message.startswith("Mamba(temporal_dtype=None): ")
    assert "give temporal_dtype=" in message and "or dtype=" in message


def test_an_invalid_override_is_refused_even_beside_a_valid_default() -> None:
    message = config_error(lambda: layouts.Mamba(2, (4,), ((3,),), torch.float16, conv_dtype="bfloat17"))  # type: ignore[arg-type]
    assert message.startswith("Mamba(conv_dtype='bfloat17'): ")


def test_the_layout_is_frozen_and_hashable_with_mixed_dtypes() -> None:
    a = layouts.Mamba(2, (4,), ((3,),), temporal_dtype=torch.float32, conv_dtype=torch.bfloat16)
    b = layouts.Mamba(2, [4], [[3]], temporal_dtype=torch.float32, conv_dtype=torch.bfloat16)  # type: ignore[arg-type]
    assert a == b and hash(a) == hash(b)
    assert a != layouts.Mamba(2, (4,), ((3,),), temporal_dtype=torch.float32, conv_dtype=torch.float16)
    with pytest.raises(AttributeError):
        a.conv_dtype = torch.float32  # type: ignore[misc]
