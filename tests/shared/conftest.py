"""Fixtures of the shared-region tests: the host tests' private /dev/shm directory."""

from __future__ import annotations

from ..host.conftest import shm_dir

__all__ = ["shm_dir"]
