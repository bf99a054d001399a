"""Fixtures and helpers of the host tests."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pinpool._node import NodeAdmission, NodePacing


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


@contextlib.contextmanager
def mounted_tmpfs(size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``) mounted for the block (root only; the test is skipped where
    mounting is not permitted), unmounted after it."""
    point = Path(tempfile.mkdtemp(prefix="pinpool-tmpfs-"))
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(point)]
    done = subprocess.run(mount, capture_output=True)
    if done.returncode != 0:
        point.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield point
    finally:
        gc.collect()
        subprocess.run(["umount", "-l", str(point)], check=False)
        point.rmdir()


@pytest.fixture
def node_dir(tmp_path: Path) -> Path:
    return tmp_path / "node"


def admission(directory: Path, *, slots: int | None = None, budget: int | None = None, wait: bool = False,
              label: str = "test", on_waiting: Callable[..., object] | None = None) -> NodeAdmission:  # fmt: skip
    """A node admission over a fresh pacing config of ``directory``."""
    pacing = NodePacing(directory=str(directory), slots=slots, budget_bytes=budget, wait=wait)
    return NodeAdmission(pacing, label=label, on_waiting=on_waiting)  # type: ignore[arg-type]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def in_thread(target: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``target`` on a daemon thread; its result or exception lands in the list."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(target())
        except BaseException as exc:  # handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out
