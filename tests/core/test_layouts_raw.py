"""`layouts.Raw`: a plain uint8 byte pool."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pinpool import ConfigError, layouts
from pinpool._plan import plan_chunks
from pinpool.layouts import BufferSpec, Raw


def test_default_raw_is_one_unaligned_uint8_buffer() -> None:
    raw = Raw()
    assert raw.granularity_bytes is None
    assert raw.name == "raw"
    assert raw.page_bytes == 1
    (spec,) = raw.buffers(4096)
    assert spec == BufferSpec("data", (4096,), torch.uint8, None, 1)
    assert spec.nbytes == 4096


@pytest.mark.parametrize(("granularity", "nbytes"), [(1, 7), (60, 1000), (4096, 3 * 4096 + 5), (300 << 20, 2500 << 20)])
def test_raw_with_granularity_holds_exactly_size_bytes(granularity: int, nbytes: int) -> None:
    # A byte pool's page is one byte: the pool holds exactly size= bytes, and the granularity
    # only constrains chunk boundaries (the last chunk may end mid-granule, as in 900+900+700 MiB).
    raw = Raw(granularity)
    assert raw.granularity_bytes == granularity
    assert raw.page_bytes == 1
    specs = raw.buffers(nbytes)
    assert len(specs) == 1
    spec = specs[0]
    assert spec.name == "data"
    assert spec.shape == (nbytes,)
    assert spec.dtype is torch.uint8
    assert spec.granularity == granularity
    assert spec.nbytes == nbytes


def test_raw_keyword_argument() -> None:
    (spec,) = Raw(granularity_bytes=512).buffers(1024)
    assert spec.shape == (1024,)
    assert spec.granularity == 512


def test_buffers_zero_pages() -> None:
    (spec,) = Raw(60).buffers(0)
    assert spec.shape == (0,)
    assert spec.nbytes == 0


@pytest.mark.parametrize("granularity", [0, -1, -4096, True, False, 1.5, "4096"])
def test_invalid_granularity(granularity: object) -> None:
    with pytest.raises(ConfigError) as info:
        Raw(granularity)  # type: ignore[arg-type]
    message = str(info.value)
    assert f"Raw(granularity_bytes={granularity!r})" in message
    assert "positive int" in message
    assert "None" in message  # the alternative


def test_invalid_granularity_keyword_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"granularity_bytes=0\b"):
        Raw(granularity_bytes=0)


def test_raw_is_a_layout() -> None:
    assert isinstance(Raw(), layouts.Layout)
    assert isinstance(Raw(4096), layouts.Layout)
    assert not isinstance(object(), layouts.Layout)  # the check is not vacuous


def test_raw_is_frozen_and_hashable() -> None:
    raw = Raw(60)
    with pytest.raises(dataclasses.FrozenInstanceError):
        raw.granularity_bytes = 4096  # type: ignore[misc]
    assert raw == Raw(60)
    assert raw != Raw()
    assert hash(raw) == hash(Raw(60))


def test_buffer_spec_nbytes_uses_itemsize() -> None:
    assert BufferSpec("k", (2, 3, 4), torch.float16, 48).nbytes == 2 * 3 * 4 * 2
    assert BufferSpec("s", (), torch.float32, None).nbytes == 4


def test_raw_buffer_plans_on_granule_boundaries() -> None:
    # MLA page_first_direct granularity (60 B): boundaries must be multiples of 60 and the OS page
    raw = Raw(60)
    (spec,) = raw.buffers(6_000_000)
    plan = plan_chunks(spec.nbytes, granularity=spec.granularity, limit=1 << 20, page_size=4096)
    assert plan.unit == 61440
    assert len(plan.chunks) > 1
    assert all(c.offset % 60 == 0 and c.offset % 4096 == 0 for c in plan.chunks)
    assert plan.chunks[-1].end == spec.nbytes == 6_000_000
