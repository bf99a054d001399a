"""pytest plugin for code built on pinpool (docs/testing.md): the leak-checked fixtures ``fake_runtime``,
``fake_auto_runtime`` and ``pinned_pool_factory``, and the ``gpu`` marker (skipped without a CUDA device).
Installing pinpool registers it (``pytest11``); pinpool and torch are imported only when a test needs them.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch
    from prometheus_client import CollectorRegistry

    from pinpool import PinnedPool
    from pinpool.testing import FakeRuntime

__all__ = ["GPU_MARKER", "PinnedPoolFactory", "entry_point", "fake_auto_runtime", "fake_runtime", "pinned_pool_factory"]

GPU_MARKER = "gpu: needs a CUDA device; skipped cleanly without one"

# The pytest11 entry point names this stub, not this module: pytest registers an entry point's module
# under the entry point's name ("pinpool"), and one module under two names is an error. The stub asks
# for this module by its import name (as ``-p pinpool.pytest_plugin`` does), so it loads once.
entry_point = types.ModuleType(f"{__name__}.entry_point", "Loads pinpool.pytest_plugin once (the pytest11 entry).")
entry_point.__dict__["pytest_plugins"] = [__name__]

_CUDA_REASON = pytest.StashKey[str | None]()


def pytest_configure(config: pytest.Config) -> None:
    declared = config.getini("markers")
    if not any(str(line).split(":", 1)[0].strip() == "gpu" for line in declared):
        config.addinivalue_line("markers", GPU_MARKER)


def _cuda_missing() -> str | None:
    """Why CUDA tests cannot run here, or None when torch sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return "needs a CUDA device: torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not marked:
        return  # torch is imported only when some test asks for a GPU
    if _CUDA_REASON not in config.stash:
        config.stash[_CUDA_REASON] = _cuda_missing()
    reason = config.stash[_CUDA_REASON]
    if reason is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


def _leak_message(fake: FakeRuntime, owner: str) -> str | None:
    registered = fake.registered
    if not registered:
        return None
    ranges = ", ".join(f"[{base:#x}, +{nbytes} B)" for base, nbytes in sorted(registered.items()))
    return (
        f"{owner}: {len(registered)} range(s) still registered after the test, "
        f"{sum(registered.values())} bytes: {ranges}. A pool or pin() was "
        "entered and never exited, or its teardown failed (UnpinError.leaked). A test that makes "
        "unregister fail on purpose unregisters the leftovers itself: "
        "for base in list(fake.registered): fake.unregister(base)"
    )


@pytest.fixture
def fake_runtime() -> Iterator[FakeRuntime]:
    """A fresh :class:`pinpool.testing.FakeRuntime`; the test errors at teardown if it still holds a registration."""
    from pinpool.testing import FakeRuntime

    fake = FakeRuntime()
    yield fake
    message = _leak_message(fake, "fake_runtime")
    if message is not None:
        pytest.fail(message, pytrace=False)


@pytest.fixture
def fake_auto_runtime(fake_runtime: FakeRuntime) -> Iterator[FakeRuntime]:
    """The test's ``fake_runtime``, which ``runtime="auto"`` (the default) is during the test: for a server that
    builds its own pool (its lifespan), with no runtime parameter to pass a fake through. Leak-checked as it is."""
    from pinpool.testing import auto_runtime

    with auto_runtime(fake_runtime):
        yield fake_runtime


class PinnedPoolFactory:
    """The ``pinned_pool_factory`` fixture: ``factory(size=..., **options)`` is :class:`pinpool.PinnedPool`
    and :meth:`pin` is :func:`pinpool.pin`, with ``runtime`` the test's ``fake_runtime`` and ``registry``
    a ``CollectorRegistry`` of this test alone unless given; :attr:`pools` lists what was built."""

    def __init__(self, fake: FakeRuntime, registry: CollectorRegistry) -> None:
        self.fake_runtime = fake
        self.registry = registry
        self.pools: list[PinnedPool] = []

    def __call__(self, *, size: int | str, **options: Any) -> PinnedPool:
        import pinpool

        return self._built(pinpool.PinnedPool, size=size, **options)

    def pin(self, tensor: torch.Tensor, **options: Any) -> PinnedPool:
        import pinpool

        return self._built(pinpool.pin, tensor, **options)

    def _built(self, make: Callable[..., PinnedPool], *args: Any, **options: Any) -> PinnedPool:
        pool = make(*args, **{"runtime": self.fake_runtime, "registry": self.registry, **options})
        self.pools.append(pool)
        return pool

    def check(self) -> list[str]:
        """Exit every pool still open, and say what was wrong; called at the test's teardown."""
        import pinpool
        from pinpool.testing import FakeRuntime

        problems: list[str] = []
        for pool in self.pools:
            if pool.state.value in ("new", "closed"):
                continue
            problems.append(f"pool {pool.name!r} was entered and never exited; the fixture exited it: {pool!r}")
            try:
                pool.__exit__(None, None, None)
            except pinpool.PinpoolError as exc:  # UnpinError, or what a failed background pinning kept
                problems.append(f"exiting pool {pool.name!r} at teardown raised {type(exc).__name__}: {exc}")
        fakes = {id(pool.runtime): pool.runtime for pool in self.pools if isinstance(pool.runtime, FakeRuntime)}
        for fake in fakes.values():
            if fake is not self.fake_runtime:  # the fake_runtime fixture checks its own books
                names = ", ".join(repr(pool.name) for pool in self.pools if pool.runtime is fake)
                message = _leak_message(fake, f"the FakeRuntime of pool(s) {names}")
                if message is not None:
                    problems.append(message)
        problems.extend(
            f"pool {pool.name!r} still has {pool.pinned_bytes} bytes pinned after exit (its unpinning failed)"
            for pool in self.pools
            if not isinstance(pool.runtime, FakeRuntime) and pool.pinned_bytes
        )
        return problems


@pytest.fixture
def pinned_pool_factory(fake_runtime: FakeRuntime) -> Iterator[PinnedPoolFactory]:
    """Leak-checked pools: ``pinned_pool_factory(size=..., **options)``; see :class:`PinnedPoolFactory`."""
    from prometheus_client import CollectorRegistry

    factory = PinnedPoolFactory(fake_runtime, CollectorRegistry())
    yield factory
    problems = factory.check()
    if problems:
        pytest.fail("pinned_pool_factory:\n- " + "\n- ".join(problems), pytrace=False)
