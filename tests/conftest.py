from __future__ import annotations

import gc
from collections.abc import Callable

import pytest

import pinpool
from pinpool import _libc


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _mlock_budget() -> int:
    if _libc.has_cap_ipc_lock():
        return 1 << 62
    soft, _hard = _libc.memlock_limits()
    return 1 << 62 if soft == _libc.RLIM_INFINITY else soft


needs_mlock = pytest.mark.skipif(
    _mlock_budget() < (256 << 20),
    reason="needs CAP_IPC_LOCK or RLIMIT_MEMLOCK >= 256 MiB to lock real pools (run as root or raise ulimit -l)",
)


@pytest.fixture
def vmlck_baseline() -> int:
    """VmLck before the test; the test asserts it comes back to this."""
    gc.collect()
    return _libc.vm_locked_bytes()


async def pin_and_run(
    pool: pinpool.PinnedPool, mode: str, body: Callable[[pinpool.PinnedPool], None] = lambda p: None
) -> None:
    """Enter ``pool`` with ``async with`` (mode "async") or ``with`` (mode "sync") and run ``body`` inside."""
    if mode == "async":
        async with pool as entered:
            body(entered)
    else:
        with pool as entered:
            body(entered)
