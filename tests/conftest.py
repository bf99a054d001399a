from __future__ import annotations

import gc

import pytest

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
