from __future__ import annotations

import fcntl
import gc
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import pinpool
from pinpool._host import libc as _libc
from pinpool.testing import FakeRuntime, locked_bytes

# pinpool's own pytest plugin (the gpu marker's skip, the fixtures), loaded from here rather than
# through its installed pytest11 entry point, which pyproject's addopts turn off (-p no:pinpool):
# an entry point is imported before pytest-cov starts measuring, so coverage would miss every
# line pinpool and its eagerly imported modules run at import.
pytest_plugins = ["pinpool.pytest_plugin"]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# A pool test under each driver, for an ``async def`` test that enters its pool by ``mode``
# (pin_and_run, or ``if mode == "async"``): the async driver on both anyio backends, the sync
# driver once. ``with pool`` never awaits, so a second backend would only repeat it; a plain
# ``parametrize("mode", ["async", "sync"])`` did that (pytest_runtest_setup below fails
# such a test's second run).
each_driver = pytest.mark.parametrize(
    ("mode", "anyio_backend"),
    [
        pytest.param("async", "asyncio", id="async-asyncio"),
        pytest.param("async", "trio", id="async-trio"),
        pytest.param("sync", "asyncio", id="sync"),
    ],
)


@pytest.fixture
def hugetlb_lock() -> Iterator[None]:
    """Held for the whole test: an exclusive flock on a host-wide file. The hugetlb pool
    (/proc/sys/vm/nr_hugepages, HugePages_Free) is one per host, so tests that reserve, use or
    count its pages take turns, whether they run on parallel xdist workers (./dev test) or in
    another pytest process on the host. (Not xdist_group: under pytest 9.2, xdist 3.8's
    --dist loadgroup no longer groups anything.)"""
    path = os.path.join(tempfile.gettempdir(), "pinpool-tests-hugetlb.lock")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except PermissionError:  # another user's file in a sticky /tmp: flock needs only a read descriptor
        fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


# Marks a test that reserves, uses or counts the host's hugetlb pages (see hugetlb_lock).
hugetlb_pages = pytest.mark.usefixtures("hugetlb_lock")


def pytest_runtest_setup(item: pytest.Item) -> None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if params.get("mode") == "sync" and params.get("anyio_backend") == "trio":
        pytest.fail(
            "this test runs the sync driver once per anyio backend (the same test twice): use @each_driver "
            "from tests/conftest.py instead of parametrize('mode', ['async', 'sync'])",
            pytrace=False,
        )


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
def fake(fake_runtime: FakeRuntime) -> FakeRuntime:
    """The plugin's leak-checked ``fake_runtime``: the test errors if it leaves a range registered."""
    return fake_runtime


@pytest.fixture
def vmlck_baseline() -> int:
    """VmLck before the test; the test asserts it comes back to this."""
    gc.collect()
    return locked_bytes()


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


def cancel_at_first(op: str, scope: anyio.CancelScope) -> Callable[[str, int, int], None]:
    """A FakeRuntime ``before_call``/``after_call`` hook that cancels ``scope`` at the first ``op`` call
    (from the worker thread, through the event loop): a cancellation that lands at an event, not a guessed delay."""
    token, fired = anyio.lowlevel.current_token(), threading.Event()

    def hook(called: str, ptr: int, nbytes: int) -> None:
        if called == op and not fired.is_set():
            fired.set()
            anyio.from_thread.run_sync(scope.cancel, token=token)

    return hook


def mapped(address: int) -> bool:
    """Whether ``address`` is in one of this process's mappings (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def lifecycle_of(pool: pinpool.PinnedPool) -> Any:
    """The sans-I/O lifecycle behind a pool: the one place tests reach past the façade (the
    lifecycle's own tests, the engine's books, fault injection into a pool's mapping)."""
    return pool._lifecycle


def config_error(make: Callable[[], object]) -> str:
    """The message of the ConfigError ``make()`` raises."""
    with pytest.raises(pinpool.ConfigError) as info:
        make()
    return str(info.value)


def check_host(options: Any, host: Any, runtime: object = None, **kwargs: Any) -> None:
    """The pre-flight for a runtime given as the pool takes it (a name, an object or Capabilities)."""
    from pinpool._plan import check_host as check
    from pinpool.runtimes import pinning_capabilities

    check(options, host, pinning_capabilities(runtime, host), **kwargs)
