"""An elastic pool's shared file holds what it pins (docs/shared-memory.md, "Reserving the pages"): creating the
region allocates the floor's pages and the trailer's only, each segment is allocated as it grows (before it is
faulted), and a file system without room for a segment is a ConfigError from the grow, never a SIGBUS. Real
mlock, real /dev/shm, and a real tmpfs of 16 MiB mounted for the test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import pinpool
from pinpool import layouts
from pinpool._host import libc as _libc
from pinpool.testing import FakeRuntime, locked_bytes

from ..conftest import needs_mlock
from ..host.conftest import mounted_tmpfs

MiB = 1 << 20
PAGE = _libc.PAGE_SIZE


def blocks(path: Path) -> int:
    return os.stat(path).st_blocks * 512


@needs_mlock
def test_the_file_holds_the_floor_then_each_segment_grown(shm_dir: Path) -> None:
    """K and V buffers: the floor is a slice of each, not a prefix of the file; each is allocated, nothing else."""
    layout = layouts.MHA("page_first", layer_num=2, page_size=16, head_num=2, head_dim=64, dtype=torch.bfloat16)
    page = layout.page_bytes  # 16 KiB: 8 KiB of K, 8 KiB of V
    path = shm_dir / "kv"
    pool = pinpool.PinnedPool(
        layout=layout, num_pages=256, reserve=1024 * page, grow_step=256 * page, runtime="mlock", registry=None,
        memory=pinpool.SharedMemory(path),
    )  # fmt: skip
    with pool:
        assert os.stat(path).st_size == 16 * MiB + PAGE  # the whole reservation is the file's size ...
        assert blocks(path) == 4 * MiB + PAGE  # ... but it holds the floor (2 MiB of K, 2 of V) and the trailer
        pool.grow_sync(pages=256)
        assert blocks(path) == 8 * MiB + PAGE
        pool.shrink_sync(to_pages=256)
        assert blocks(path) == 4 * MiB + PAGE
    fixed = pinpool.PinnedPool(
        layout=layout, num_pages=512, runtime=FakeRuntime(), registry=None, memory=pinpool.SharedMemory(path)
    )
    with fixed:  # a fixed pool's file: all of it, as before
        assert blocks(path) == 8 * MiB + PAGE


@needs_mlock
def test_a_full_file_system_at_grow_time_is_a_config_error_and_the_pool_serves_on() -> None:
    with mounted_tmpfs("16M") as mount:
        path = mount / "kv"
        pool = pinpool.PinnedPool(
            size=4 * MiB, reserve=24 * MiB, grow_step=8 * MiB, chunk_bytes=MiB, runtime="mlock", registry=None,
            memory=pinpool.SharedMemory(path),
        )  # fmt: skip
        with pool:  # the reservation is larger than the mount: only the floor is taken from it
            assert blocks(path) == 4 * MiB + PAGE
            pool.grow_sync(pages=8 * MiB)
            assert blocks(path) == 12 * MiB + PAGE
            before = locked_bytes()
            with pytest.raises(
                pinpool.ConfigError,
                match=r"allocating \[12582912, \+8388608\) \(8 MiB\) of its file failed: the file system could not "
                r"allocate it \(No space left on device\); nothing of it is pinned, and it stays a hole \(it reads "
                r"zero\). It needs room on its file system \(df\): make room, or grow by less",
            ):
                pool.grow_sync(pages=8 * MiB)
            assert pool.pinned_runs == (range(0, 12 * MiB),) and locked_bytes() == before  # as it was
            assert blocks(path) == 12 * MiB + PAGE  # nothing of the segment was left allocated
            pool.tensor[: 12 * MiB].fill_(1)  # every usable page serves on
            pool.shrink_sync(to_pages=4 * MiB)
            assert pool.grow_sync(pages=8 * MiB).pages == (range(4 * MiB, 12 * MiB),)  # room again: it grows
