"""Fixtures of the host tests."""

from __future__ import annotations

import gc
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory on /dev/shm (mode 0700), removed with whatever the test left in it."""
    path = Path("/dev/shm") / f"pinpool-test-{uuid.uuid4().hex[:12]}"
    path.mkdir(mode=0o700)
    try:
        yield path
    finally:
        gc.collect()
        shutil.rmtree(path, ignore_errors=True)
