"""Every way pinning can end early has its own cause, alike in the metric label and the log event.

Table-driven over path x driver x mode, with the real drivers and threads. Only ``failure``
is a failure (the shipped alert pages on it alone); a body that leaves while a background pool
pins is a normal shutdown (``exit``, logged at info).
"""

from __future__ import annotations

import gc
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
import structlog
import structlog.testing
from prometheus_client import CollectorRegistry

import pinpool
from pinpool import PinError, PoolState, UnclosedPoolWarning
from pinpool._pin import Outcome
from pinpool.testing import FakeRuntime

from ..conftest import cancel_at_first, lifecycle_of

MiB = 1 << 20
BACKENDS = ("asyncio", "trio")
STOP_CAUSES = tuple(o.cause for o in Outcome if o is not Outcome.READY)

STOP_CAUSES = tuple(o.cause for o in Outcome if o is not Outcome.READY)  # every rollback cause


class Run:
    """One scenario's pool, books and what it logged."""

    def __init__(self, *, background: bool, fail_on: int | None = None, on_progress: Any = None) -> None:
        self.fake = FakeRuntime(register_delay=0.01, fail_register_on=fail_on)
        self.registry = CollectorRegistry()
        self.events: list[dict[str, Any]] = []

        def keep(_logger: Any, method: str, event: dict[str, Any]) -> Any:
            self.events.append({**event, "log_level": method})
            raise structlog.DropEvent

        self.pool: pinpool.PinnedPool | None = pinpool.PinnedPool(
            size=16 * MiB, chunk_bytes=MiB, runtime=self.fake, register_workers=1, populate=False, max_retries=0,
            background=background, name="causes", registry=self.registry, on_progress=on_progress,
            logger=structlog.wrap_logger(structlog.testing.CapturingLogger(), processors=[keep]),
        )  # fmt: skip

    def counted(self) -> dict[str, float]:
        return {
            cause: self.registry.get_sample_value(
                "pinpool_rollbacks_total", {"pool": "causes", "runtime": "fake", "cause": cause}
            )
            or 0.0
            for cause in STOP_CAUSES
        }

    def logged(self) -> list[tuple[str, str]]:
        return [(e["cause"], e["log_level"]) for e in self.events if e["event"] == "pool.rollback"]


def stop_at_third_chunk(*_: Any) -> None:
    raise LookupError("on_progress says stop")


def raising_progress() -> Callable[..., None]:
    calls = [0]

    def on_progress(*_: Any) -> None:
        calls[0] += 1
        if calls[0] >= 2:
            raise LookupError("on_progress says stop")

    return on_progress


async def wait_for(run: Run, state: PoolState) -> None:
    assert run.pool is not None
    deadline = time.monotonic() + 60  # a generous timeout: 1000 polls of 5 ms were 5 s or more
    while time.monotonic() < deadline:
        if run.pool.state is state:
            return
        await anyio.sleep(0.005)
    raise AssertionError(f"never {state}")


def wait_for_sync(run: Run, state: PoolState) -> None:
    anyio.run(wait_for, run, state)


# -- the scenarios: path x mode, each for the drivers that can reach it -----------------------------


def failure_fg(run: Run, driver: str) -> None:
    assert run.pool is not None
    if driver == "sync":
        with pytest.raises(PinError), run.pool:
            pass
        return

    async def main() -> None:
        assert run.pool is not None
        with pytest.raises(PinError):
            async with run.pool:
                pass

    anyio.run(main, backend=driver)


def failure_bg(run: Run, driver: str) -> None:
    assert run.pool is not None
    if driver == "finalizer":  # failed, never exited, then dropped: counted once, as a failure
        run.pool.__enter__()
        wait_for_sync(run, PoolState.FAILED)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnclosedPoolWarning)
            run.pool = None
            gc.collect()
        return
    if driver == "sync":
        with pytest.raises(PinError), run.pool:
            wait_for_sync(run, PoolState.FAILED)
        return

    async def main() -> None:
        assert run.pool is not None
        with pytest.raises(PinError):
            async with run.pool:
                await wait_for(run, PoolState.FAILED)

    anyio.run(main, backend=driver)


def cancelled_fg(run: Run, driver: str) -> None:
    assert run.pool is not None
    if driver == "sync":  # on_progress raising is the sync twin's interruption (Ctrl-C is in test_signals_mlock)
        lifecycle_of(run.pool).on_progress = raising_progress()
        with pytest.raises(LookupError), run.pool:
            pass
        return

    async def main() -> None:
        assert run.pool is not None
        # Cancelled at the first registration, so always while pinning (a 50 ms deadline guessed it).
        scope = anyio.CancelScope()
        run.fake.before_call = cancel_at_first("register", scope)
        with scope:
            async with run.pool:
                raise AssertionError("a cancelled pinning never enters its body")

    anyio.run(main, backend=driver)


def cancelled_bg(run: Run, driver: str) -> None:
    assert run.pool is not None
    lifecycle_of(run.pool).on_progress = raising_progress()
    if driver == "sync":
        with pytest.raises(LookupError), run.pool:
            wait_for_sync(run, PoolState.FAILED)
        return

    async def main() -> None:
        assert run.pool is not None
        with pytest.raises(LookupError):
            async with run.pool:
                await wait_for(run, PoolState.FAILED)

    anyio.run(main, backend=driver)


def exit_bg(run: Run, driver: str) -> None:
    assert run.pool is not None
    if driver == "sync":
        with run.pool:
            run.pool.wait_ready_sync(min_bytes=MiB)
        return

    async def main() -> None:
        assert run.pool is not None
        async with run.pool:
            await run.pool.wait_ready(min_bytes=MiB)

    anyio.run(main, backend=driver)


def collected_bg(run: Run, driver: str) -> None:
    assert run.pool is not None
    run.pool.__enter__()
    run.pool.wait_ready_sync(min_bytes=MiB)
    lifecycle = lifecycle_of(run.pool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnclosedPoolWarning)
        run.pool = None
        gc.collect()
    assert lifecycle._closed.wait(10)  # the conductor unpins when it is done


def ready_then_collected_fg(run: Run, driver: str) -> None:
    assert run.pool is not None
    run.pool.__enter__()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnclosedPoolWarning)
        run.pool = None
        gc.collect()


# (path, mode, scenario, pool options, drivers, expected cause or None, its log level)
ROWS: list[tuple[str, str, Callable[[Run, str], None], dict[str, Any], tuple[str, ...], str | None, str]] = [
    ("failure", "foreground", failure_fg, {"fail_on": 4}, ("sync", *BACKENDS), "failure", "warning"),
    ("failure", "background", failure_bg, {"fail_on": 4}, ("sync", *BACKENDS, "finalizer"), "failure", "warning"),
    ("cancelled", "foreground", cancelled_fg, {}, ("sync", *BACKENDS), "cancelled", "warning"),
    ("cancelled", "background", cancelled_bg, {}, ("sync", *BACKENDS), "cancelled", "warning"),
    ("exit", "background", exit_bg, {}, ("sync", *BACKENDS), "exit", "info"),
    ("collected", "background", collected_bg, {}, ("finalizer",), "collected", "warning"),
    ("none", "foreground", ready_then_collected_fg, {}, ("finalizer",), None, ""),
]
# Combinations a pool cannot reach, and why (kept here so the table is the whole story):
# exit x foreground: a foreground body never runs while its pool pins.
# collected x foreground: the driver holds a foreground pool until its pinning ends.
# cancelled x finalizer: a finalizer does not interrupt; it stops a pinning as "collected".
CASES = [
    pytest.param(scenario, options, mode == "background", driver, cause, level, id=f"{path}-{mode}-{driver}")
    for path, mode, scenario, options, drivers, cause, level in ROWS
    for driver in drivers
]


@pytest.mark.parametrize(("scenario", "options", "background", "driver", "cause", "level"), CASES)
def test_the_stop_cause_table(
    scenario: Callable[[Run, str], None],
    options: dict[str, Any],
    background: bool,
    driver: str,
    cause: str | None,
    level: str,
) -> None:
    run = Run(background=background, **options)
    scenario(run, driver)
    expected = {c: (1.0 if c == cause else 0.0) for c in STOP_CAUSES}
    assert run.counted() == expected  # only the path's own cause; never "failure" for a shutdown
    assert run.logged() == ([(cause, level)] if cause else [])
    assert run.fake.registered == {}  # and whatever ended it, everything is unpinned in the end
    # A worker has done its last step once the pool is closed; its thread may take a moment more to end.
    deadline = time.monotonic() + 10
    while (
        left := [t for t in threading.enumerate() if t.name.startswith("pinpool-causes")]
    ) and time.monotonic() < deadline:
        left[0].join(0.05)
    assert not left
