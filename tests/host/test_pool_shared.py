"""PinnedPool(memory=SharedMemory(...)): a shared, file-backed region with every pool feature."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

import pinpool
from pinpool import ConfigError, PoolState, layouts
from pinpool.testing import locked_bytes

from .. import preloaded
from ..conftest import needs_mlock

pytestmark = needs_mlock
MiB = 1 << 20


@pytest.fixture
def region(tmp_path: Path) -> Path:
    shm = Path("/dev/shm")
    path = shm / f"pinpool-test-{os.getpid()}-{tmp_path.name}"
    yield path
    path.unlink(missing_ok=True)


def test_a_shared_pool_pins_locks_and_its_creator_removes_the_file(region: Path, vmlck_baseline: int) -> None:
    shared = pinpool.SharedMemory(region, create=True)
    with pinpool.PinnedPool(size=32 * MiB, runtime="mlock", memory=shared, registry=None, name="shm") as pool:
        assert pool.state is PoolState.READY and region.exists()
        assert locked_bytes() - vmlck_baseline >= 32 * MiB
        pool.tensor[:4] = 9
    assert locked_bytes() == vmlck_baseline and not region.exists()


def test_a_kept_region_is_reattached_with_its_bytes_and_a_mismatch_is_refused(
    region: Path, vmlck_baseline: int
) -> None:
    layout = layouts.Raw(granularity_bytes=MiB)
    with pinpool.PinnedPool(
        layout=layout, size=16 * MiB, runtime="mlock", registry=None,
        memory=pinpool.SharedMemory(region, create=True, keep=True),
    ) as pool:  # fmt: skip
        pool.tensor[: 1 << 10] = 42
    assert region.exists() and locked_bytes() == vmlck_baseline
    again = pinpool.PinnedPool(
        layout=layout, size=16 * MiB, runtime="mlock", registry=None, memory=pinpool.SharedMemory(region, create=False)
    )
    with again:
        assert int(again.tensor[:1024].min()) == 42 == int(again.tensor[:1024].max())  # warm: the bytes survived
    assert region.exists()  # an attacher never removes the file
    wrong = pinpool.PinnedPool(
        layout=layout, size=32 * MiB, runtime="mlock", registry=None, memory=pinpool.SharedMemory(region, create=False)
    )
    with pytest.raises(ConfigError) as raised, wrong:
        pass
    assert "16" in str(raised.value) and "32" in str(raised.value)  # names what the file holds and what was asked
    assert locked_bytes() == vmlck_baseline


def test_a_background_shared_pool_and_close(region: Path, vmlck_baseline: int) -> None:
    pool = pinpool.PinnedPool(
        size=64 * MiB, runtime="mlock", registry=None, background=True, chunk_bytes=8 * MiB,
        memory=pinpool.SharedMemory(region, create=True),
    ).open()  # fmt: skip
    pool.wait_ready_sync(timeout=60)
    assert pool.registrations and sum(r.nbytes for r in pool.registrations) == 64 * MiB
    pool.close()
    assert locked_bytes() == vmlck_baseline and not region.exists()


@pytest.mark.parametrize(
    ("option", "words"),
    [({"huge_pages": True}, "drop huge_pages="), ({"numa_node": 0}, "is not supported"), ({}, "pinpool.pin")],
)
def test_options_a_shared_region_cannot_take_are_config_errors(
    region: Path, option: dict[str, object], words: str
) -> None:
    memory: object = pinpool.SharedMemory(region, create=True) if option else object()
    with pytest.raises(ConfigError, match=words):
        pinpool.PinnedPool(size=MiB, runtime="mlock", registry=None, memory=memory, **option)  # type: ignore[arg-type]
    assert not region.exists()  # nothing is created before entry


def test_two_processes_attach_one_region_and_see_each_others_bytes(region: Path) -> None:
    child = textwrap.dedent(
        f"""
        import pinpool
        from pinpool.testing import locked_bytes
        memory = pinpool.SharedMemory({str(region)!r}, create=False)
        with pinpool.PinnedPool(size={16 * MiB}, runtime="mlock", memory=memory, registry=None) as pool:
            assert int(pool.tensor[123]) == 77, int(pool.tensor[123])
            pool.tensor[456] = 88
            print("child VmLck", locked_bytes())
        print("child after", locked_bytes())
        """
    )
    with pinpool.PinnedPool(
        size=16 * MiB, runtime="mlock", registry=None, memory=pinpool.SharedMemory(region, create=True)
    ) as pool:
        pool.tensor[123] = 77
        result = preloaded.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert f"child VmLck {16 * MiB}" in result.stdout and "child after 0" in result.stdout
        assert int(pool.tensor[456]) == 88  # written by the other process, through its own mapping
    assert not region.exists()
