"""A shared region survives its creator's SIGKILL (docs/shared-memory.md, "After a crash"): a real
child process creates and mlocks a pool on /dev/shm, writes a pattern and is SIGKILLed in its body;
the next process re-attaches, pins, and finds the bytes, region id and generation as they were.
Who removes a region its creator did not keep (``adopt=True``), and what doctor says about it."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import pinpool
from pinpool import ConfigError, layouts
from pinpool._cli import OK, WARN, check_region, main
from pinpool._shared import find_regions, read_region
from pinpool.testing import locked_bytes

from .. import preloaded
from ..conftest import needs_mlock

pytestmark = needs_mlock
MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
NBYTES = 64 * MiB
LAYOUT = layouts.Raw(granularity_bytes=MiB)

# The server that dies: it pins a shared pool, fills it, says so, and waits in its body for the SIGKILL.
DOOMED = """
import hashlib, sys, time
import torch
import pinpool
from pinpool import layouts
from pinpool.testing import locked_bytes
path, nbytes, keep = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "keep"
shared = pinpool.SharedMemory(path, create=True, keep=keep)
pool = pinpool.PinnedPool(layout=layouts.Raw(granularity_bytes=1 << 20), size=nbytes, runtime="mlock",
                          memory=shared, registry=None, name="doomed")
with pool:
    gen = torch.Generator().manual_seed(36)
    pool.tensor.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
    shared.set_generation(17)
    digest = hashlib.sha256(pool.tensor.numpy()).hexdigest()
    print("READY", digest, shared.region_id, shared.generation, locked_bytes(), flush=True)
    time.sleep(3600)  # mid-body: SIGKILLed here, the pool still pinned
"""


def create_and_kill(path: Path, *, keep: bool) -> tuple[str, str, int]:
    """Run DOOMED, SIGKILL it once its pool is filled: ``(sha256, region_id, generation)`` it reported."""
    with preloaded.spawn(
        [sys.executable, "-c", DOOMED, str(path), str(NBYTES), "keep" if keep else "nokeep"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    ) as child:  # fmt: skip
        assert child.stdout is not None
        line = child.stdout.readline()  # blocks until the body is reached (or the child failed: EOF)
        assert line.startswith("READY "), (line, child.communicate(timeout=60))
        _, digest, region_id, generation, locked = line.split()
        assert int(locked) >= NBYTES  # it was pinned (mlock) when it died
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
        assert child.returncode == -signal.SIGKILL
    return digest, region_id, int(generation)


def rewrite_created(path: Path, **created: object) -> None:
    """Change the trailer's ``created`` fields, its checksum with them (another pinpool's, or a tamperer's)."""
    with open(path, "r+b") as f:
        f.seek(-4096, os.SEEK_END)
        raw = f.read(4096)
        magic, version, length, _crc, flags, generation, reserved = struct.unpack_from("<8sIIIIQQ", raw)
        body = json.loads(raw[40 : 40 + length])
        body["created"].update(created)
        text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        head = struct.pack("<8sIIIIQQ", magic, version, len(text), zlib.crc32(text), flags, generation, reserved)
        f.seek(-4096, os.SEEK_END)
        f.write((head + text).ljust(3072, b"\0"))


def reattach(path: Path, shared: pinpool.SharedMemory | None = None, **kwargs: bool) -> pinpool.PinnedPool:
    return pinpool.PinnedPool(
        layout=LAYOUT, size=NBYTES, runtime="mlock", registry=None, name="successor",
        memory=shared or pinpool.SharedMemory(path, create=False, **kwargs),
    )  # fmt: skip


@pytest.mark.parametrize("keep", [False, True], ids=["not-kept", "kept"])
def test_a_region_survives_its_creators_sigkill_bytes_identity_and_generation(
    shm_dir: Path, vmlck_baseline: int, keep: bool
) -> None:
    path = shm_dir / "kv"
    digest, region_id, generation = create_and_kill(path, keep=keep)
    assert generation == 17
    left = read_region(str(path))
    assert left is not None and left.keep is keep and left.creator_alive is False and left.orphaned
    shared = pinpool.SharedMemory(path, create=False)
    pool = reattach(path, shared)
    with pool:
        assert locked_bytes() - vmlck_baseline >= NBYTES  # pinned again, in this process
        assert hashlib.sha256(pool.tensor.numpy()).hexdigest() == digest  # every byte the dead creator wrote
        assert (shared.region_id, shared.generation) == (region_id, 17)  # the same region, untouched
        held = read_region(str(path))
        assert held is not None and held.in_use and not held.orphaned  # our mapping holds its lock
    del pool
    gc.collect()
    assert locked_bytes() == vmlck_baseline
    after = read_region(str(path))
    assert after is not None and after.orphaned  # a plain attacher never removes the file, kept or not


def test_adopting_a_dead_creators_region_makes_the_successor_remove_it(shm_dir: Path, vmlck_baseline: int) -> None:
    path = shm_dir / "kv"
    digest, region_id, _generation = create_and_kill(path, keep=False)
    shared = pinpool.SharedMemory(path, create=False, adopt=True)
    pool = reattach(path, shared)
    with pool:
        assert hashlib.sha256(pool.tensor.numpy()).hexdigest() == digest
        assert shared.region_id == region_id
    del pool
    gc.collect()
    assert locked_bytes() == vmlck_baseline and not path.exists()  # the adopter let go: it removed the region


def test_an_adopter_that_keeps_it_leaves_it_kept_for_the_next_restart(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    create_and_kill(path, keep=False)
    pool = reattach(path, adopt=True, keep=True)
    with pool:
        assert read_region(str(path)).keep  # type: ignore[union-attr]  # the trailer says what the adopter will do
    del pool
    gc.collect()
    left = read_region(str(path))
    assert left is not None and left.keep and left.orphaned


def test_adopting_a_region_whose_creator_lives_is_a_config_error(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    creator = pinpool.SharedMemory(path)
    with pinpool.PinnedPool(layout=LAYOUT, size=NBYTES, runtime="mlock", registry=None, memory=creator):
        with pytest.raises(ConfigError, match=r"adopt=True\): its creator \(pid \d+\) is running: only it removes"):
            reattach(path, adopt=True).open()
        other_host = dataclasses.replace(read_region(str(path)), creator_alive=None, created_host="pod-7")  # type: ignore[type-var]
        assert not other_host.orphaned
    assert not path.exists()  # the creator removed it; the refused adopter did not keep it
    create_and_kill(path, keep=False)
    with reattach(path, adopt=True):  # one adopter at a time: the first one maps it
        with pytest.raises(ConfigError, match=r"its creator is gone, but a running process maps it"):
            reattach(path, adopt=True).open()
    gc.collect()
    assert not path.exists()  # the first adopter removed it
    create_and_kill(path, keep=True)
    rewrite_created(path, host="pod-7")  # as if made in another pod on another node, sharing the mount
    with pytest.raises(ConfigError, match=r"made on host 'pod-7', where pinpool cannot tell whether its creator"):
        reattach(path, adopt=True).open()
    rewrite_created(path, pid=None)
    with pytest.raises(ConfigError, match="its trailer names no creator pinpool can look for"):
        reattach(path, adopt=True).open()
    path.unlink()
    for bad in ({"create": True}, {"path": None}):
        with pytest.raises(ConfigError, match="adopt=True"):
            pinpool.SharedMemory(bad.get("path", path), create=bad.get("create", False), adopt=True)  # type: ignore[arg-type]


def test_doctor_says_which_regions_are_orphaned_and_removes_only_unkept_unmapped_ones(shm_dir: Path) -> None:
    create_and_kill(shm_dir / "kept", keep=True)
    create_and_kill(shm_dir / "dropped", keep=False)
    create_and_kill(shm_dir / "in-use", keep=False)
    half = shm_dir / ".kv.pinpool-new-0123456789abcdef"  # a creator killed while creating: stale
    half.write_bytes(b"\0" * 8192)
    half.chmod(0o600)
    by_name = {Path(r.path).name: r for r in find_regions([str(shm_dir)])}
    assert sorted(by_name) == ["dropped", "in-use", "kept"]  # the temporary is no region
    kept = check_region(by_name["kept"])
    assert kept.status == OK and "orphaned, re-attachable" in kept.detail and ", kept:" in kept.detail
    assert f"region id {by_name['kept'].region_id}, generation 17" in kept.detail
    assert "64 MiB region, layout raw" in kept.detail and "(gone)" in kept.detail
    dropped = check_region(by_name["dropped"])
    assert dropped.status == WARN and "orphaned, re-attachable" in dropped.detail and "not kept" in dropped.detail
    assert "adopt=True" in dropped.fix and "--remove-stale" in dropped.fix
    with reattach(shm_dir / "in-use"):
        using = read_region(str(shm_dir / "in-use"))
        assert using is not None and using.in_use and not using.orphaned
        check = check_region(using)
        assert check.status == OK and "re-attached: in use by a running process" in check.detail
        result = preloaded.run(
            [sys.executable, "-m", "pinpool", "doctor", "--no-cuda", "--no-engines", "--remove-stale",
             "--region-dir", str(shm_dir)], capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert f"{shm_dir / 'dropped'}: removed, an orphaned region, not kept, that no process mapped" in result.stdout
        assert f"{half}: removed, a region left half-made" in result.stdout
        assert sorted(p.name for p in shm_dir.iterdir()) == ["in-use", "kept"]  # mapped, or kept: left
    gc.collect()  # the successor's pool and mapping are gone: so is its lock
    assert main(["doctor", "--no-cuda", "--no-engines", "--remove-stale", "--region-dir", str(shm_dir)]) in (0, 1)
    assert [p.name for p in shm_dir.iterdir()] == ["kept"]  # orphaned again, and not kept: removed
