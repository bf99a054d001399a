"""Metrics, log events and progress: the names users build dashboards and alerts on."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
import structlog
from prometheus_client import CollectorRegistry

import pinpool
from pinpool import _probe
from pinpool.testing import FakeRuntime

from .. import preloaded
from ..conftest import cancel_at_first, each_driver

MiB = 1 << 20

pytestmark = pytest.mark.anyio


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def base(pool: str = "obs") -> dict[str, str]:
    return {"pool": pool, "runtime": "fake"}


@each_driver
async def test_metrics_follow_a_pool_through_pin_and_unpin(fake: FakeRuntime, mode: str) -> None:
    registry = CollectorRegistry()
    pool = pinpool.PinnedPool(
        size=8 * MiB, chunk_bytes=MiB, runtime=fake, name="obs", registry=registry,
        layout=pinpool.layouts.Raw(granularity_bytes=4096),
    )  # fmt: skip
    during: dict[str, float] = {}

    def read() -> None:
        during["pinned"] = sample(registry, "pinpool_pinned_bytes", **base())
        during["open"] = sample(registry, "pinpool_pools_open", **base())
        during["target"] = sample(registry, "pinpool_pool_bytes", **base())
        during["info"] = sample(
            registry, "pinpool_pool_info", **base(), layout="raw", granularity_bytes="4096", chunk_bytes=str(MiB)
        )

    if mode == "async":
        async with pool:
            read()
    else:
        with pool:
            read()
    assert during == {"pinned": 8 * MiB, "open": 1, "target": 8 * MiB, "info": 1}
    assert sample(registry, "pinpool_chunks_registered_total", **base()) == 8
    assert sample(registry, "pinpool_registered_bytes_total", **base()) == 8 * MiB
    assert sample(registry, "pinpool_chunk_register_seconds_count", **base()) == 8
    assert sample(registry, "pinpool_chunk_unregister_seconds_count", **base()) == 8
    assert sample(registry, "pinpool_pool_pin_seconds_count", **base()) == 1
    assert sample(registry, "pinpool_pool_unpin_seconds_count", **base()) == 1
    assert sample(registry, "pinpool_pinned_bytes", **base()) == 0
    assert sample(registry, "pinpool_pools_open", **base()) == 0
    assert sample(registry, "pinpool_pool_bytes", **base()) == 0
    assert sample(registry, "pinpool_chunks_in_flight", **base()) == 0


async def test_failure_and_cancellation_are_counted() -> None:
    registry = CollectorRegistry()
    with pytest.raises(pinpool.PinError):
        async with pinpool.PinnedPool(
            size=4 * MiB, chunk_bytes=MiB, runtime=FakeRuntime(fail_register_on=2), name="obs", registry=registry,
            register_workers=1, max_retries=0,
        ):  # fmt: skip
            pass
    labels = {**base(), "phase": "register", "reason": "cudaErrorMemoryAllocation"}
    assert sample(registry, "pinpool_chunk_failures_total", **labels) == 1
    assert sample(registry, "pinpool_rollbacks_total", **base(), cause="failure") == 1
    assert sample(registry, "pinpool_pinned_bytes", **base()) == 0
    assert sample(registry, "pinpool_pool_unpin_seconds_count", **base()) == 0  # a rollback is not an unpin

    # Cancelled once pinning is under way (its first registration), not after a guessed 50 ms.
    scope = anyio.CancelScope()
    with scope:
        slow = FakeRuntime(register_delay=0.01, before_call=cancel_at_first("register", scope))
        async with pinpool.PinnedPool(size=100 * MiB, chunk_bytes=MiB, runtime=slow, name="obs", registry=registry):
            pytest.fail("body must not run")
    assert sample(registry, "pinpool_rollbacks_total", **base(), cause="cancelled") == 1
    assert sample(registry, "pinpool_pinned_bytes", **base()) == 0
    assert sample(registry, "pinpool_pools_open", **base()) == 0


def test_unregister_failures_are_counted_and_leaked_bytes_stay_pinned() -> None:
    registry = CollectorRegistry()
    fake = FakeRuntime(fail_unregister_on=1)
    with (
        pytest.raises(pinpool.UnpinError),
        pinpool.PinnedPool(
            size=2 * MiB, chunk_bytes=MiB, runtime=fake, name="obs", registry=registry, register_workers=1
        ),
    ):
        pass
    labels = {**base(), "phase": "unregister", "reason": "cudaErrorMemoryAllocation"}
    assert sample(registry, "pinpool_chunk_failures_total", **labels) == 1
    assert sample(registry, "pinpool_pinned_bytes", **base()) == MiB


def test_pools_share_a_registry_and_none_disables_metrics() -> None:
    registry = CollectorRegistry()
    with pinpool.PinnedPool(size=MiB, runtime=FakeRuntime(), name="a", registry=registry):
        with pinpool.PinnedPool(size=2 * MiB, runtime=FakeRuntime(), name="b", registry=registry):
            assert sample(registry, "pinpool_pinned_bytes", **base("a")) == MiB
            assert sample(registry, "pinpool_pinned_bytes", **base("b")) == 2 * MiB
    with pinpool.PinnedPool(size=MiB, runtime=FakeRuntime(), registry=None):
        pass
    with pytest.raises(pinpool.ConfigError, match="registry="):
        pinpool.PinnedPool(size=MiB, runtime=FakeRuntime(), registry="global")  # type: ignore[arg-type]


def test_log_events_with_bound_context(fake: FakeRuntime) -> None:
    with structlog.testing.capture_logs() as logs:
        with pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake, name="logs", registry=None):
            pass
    events = [e["event"] for e in logs]
    assert events == ["pool.pin.start", *["chunk.registered"] * 4, "pool.pinned", "pool.unpinned"]
    assert all(e["pool"] == "logs" and e["runtime"] == "fake" and e["layout"] == "raw" for e in logs)
    pinned = next(e for e in logs if e["event"] == "pool.pinned")
    assert pinned["bytes"] == 4 * MiB and pinned["chunks"] == 4 and pinned["seconds"] >= 0 and pinned["gb_per_s"] > 0
    chunk = next(e for e in logs if e["event"] == "chunk.registered")
    assert chunk["log_level"] == "debug" and {"offset", "nbytes", "seconds", "attempt"} <= set(chunk)


def test_failure_log_events() -> None:
    with structlog.testing.capture_logs() as logs:
        with (
            pytest.raises(pinpool.PinError),
            pinpool.PinnedPool(
                size=4 * MiB,
                chunk_bytes=MiB,
                runtime=FakeRuntime(fail_register_on=3),
                registry=None,
                register_workers=1,
                max_retries=0,
            ),
        ):
            pass
        with (
            pytest.raises(pinpool.UnpinError),
            pinpool.PinnedPool(size=MiB, runtime=FakeRuntime(fail_unregister_on=1), registry=None),
        ):
            pass
    failed = next(e for e in logs if e["event"] == "chunk.failed")
    assert failed["offset"] == 2 * MiB and failed["code"] == 2 and failed["phase"] == "register"
    rollback = next(e for e in logs if e["event"] == "pool.rollback")
    assert rollback["cause"] == "failure" and rollback["registered_chunks"] == 2
    unpin_failed = next(e for e in logs if e["event"] == "pool.unpin.failed")
    assert unpin_failed["failures"] == 1 and unpin_failed["leaked_bytes"] == MiB


def test_logger_option_receives_the_events(fake: FakeRuntime) -> None:
    captured = structlog.testing.CapturingLogger()
    logger = structlog.wrap_logger(captured, processors=[lambda _logger, _name, event: ((), event)])
    with pinpool.PinnedPool(size=MiB, runtime=fake, registry=None, logger=logger, name="mine"):
        pass
    names = [call.kwargs["event"] for call in captured.calls]
    assert names[0] == "pool.pin.start" and names[-1] == "pool.unpinned"
    assert all(call.kwargs["pool"] == "mine" for call in captured.calls)


def test_unconfigured_structlog_prints_no_line_per_chunk() -> None:
    script = textwrap.dedent(
        """
        import pinpool
        from pinpool.testing import FakeRuntime
        with pinpool.PinnedPool(size=8 << 20, chunk_bytes=1 << 20, runtime=FakeRuntime()):
            pass
        print("done")
        """
    )
    result = preloaded.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "done\n"
    assert "chunk.registered" not in result.stderr


@each_driver
async def test_progress_from_the_callers_thread_bounded_and_final(mode: str) -> None:
    calls: list[tuple[int, int, int, int]] = []
    threads: set[int] = set()

    def on_progress(pinned: int, total: int, done: int, chunks: int) -> None:
        calls.append((pinned, total, done, chunks))
        threads.add(threading.get_ident())

    pool = pinpool.PinnedPool(
        size=40 * MiB, chunk_bytes=MiB, runtime=FakeRuntime(register_delay=0.01), register_workers=1,
        registry=None, on_progress=on_progress,
    )  # fmt: skip
    if mode == "async":
        async with pool:
            pass
    else:
        with pool:
            pass
    assert threads == {threading.get_ident()}
    assert calls[-1] == (40 * MiB, 40 * MiB, 40, 40)
    assert 2 <= len(calls) <= 0.4 / 0.1 * 3 + 1  # about every 100 ms over ~0.4 s, plus the final state
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)


async def test_progress_callback_error_rolls_back() -> None:
    fake = FakeRuntime(register_delay=0.01)

    def broken(*_: Any) -> None:
        raise LookupError("dashboard down")

    with pytest.raises(LookupError):
        async with pinpool.PinnedPool(size=50 * MiB, chunk_bytes=MiB, runtime=fake, registry=None, on_progress=broken):
            pytest.fail("must not enter")
    assert fake.registered == {}


_CHILD = textwrap.dedent(
    """
    import sys
    import pinpool
    from pinpool.testing import FakeRuntime
    with pinpool.PinnedPool(size=int(sys.argv[1]), runtime=FakeRuntime(), name="mp"):
        print("pinned", flush=True)
        sys.stdin.readline()
    """
)


def test_multiprocess_mode_sums_live_pools(tmp_path: Any) -> None:
    from prometheus_client import multiprocess

    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    children = [
        preloaded.spawn(
            [sys.executable, "-c", _CHILD, str(n * MiB)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for n in (2, 3)
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline() == "pinned\n"
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
        labels = {"pool": "mp", "runtime": "fake"}
        assert registry.get_sample_value("pinpool_pinned_bytes", labels) == 5 * MiB
        assert registry.get_sample_value("pinpool_pools_open", labels) == 2
        assert registry.get_sample_value("pinpool_chunks_registered_total", labels) == 2
    finally:
        for child in children:
            child.communicate("\n", timeout=60)
    for child in children:
        assert child.returncode == 0


@each_driver
async def test_progress_error_on_the_final_call_rolls_back(fake: FakeRuntime, mode: str) -> None:

    def broken(*_: Any) -> None:
        raise LookupError("dashboard down")

    pool = pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake, registry=None, on_progress=broken)
    with pytest.raises(LookupError):
        if mode == "async":
            async with pool:
                pytest.fail("must not enter")
        else:
            with pool:
                pytest.fail("must not enter")
    assert fake.registered == {} and len(fake.register_calls) == 4


def test_finalizer_closes_the_pool_metrics(fake: FakeRuntime) -> None:
    registry = CollectorRegistry()
    pool = pinpool.PinnedPool(size=2 * MiB, chunk_bytes=MiB, runtime=fake, name="obs", registry=registry)
    pool.__enter__()
    assert sample(registry, "pinpool_pools_open", **base()) == 1
    with pytest.warns(pinpool.UnclosedPoolWarning):
        del pool
        import gc

        gc.collect()
    assert sample(registry, "pinpool_pools_open", **base()) == 0
    assert sample(registry, "pinpool_pool_bytes", **base()) == 0
    assert sample(registry, "pinpool_pinned_bytes", **base()) == 0


def test_rollback_that_leaks_logs_unpin_failed() -> None:
    fake = FakeRuntime(fail_register_on=3, fail_unregister_on=1)
    with structlog.testing.capture_logs() as logs:
        with (
            pytest.raises(pinpool.PinError) as info,
            pinpool.PinnedPool(
                size=4 * MiB, chunk_bytes=MiB, runtime=fake, registry=None, register_workers=1, max_retries=0
            ),
        ):
            pass
    events = [e["event"] for e in logs]
    assert "pool.rollback" in events and "pool.unpin.failed" in events and "pool.unpinned" not in events
    assert len(info.value.leaked) == 1


def test_logger_must_be_a_structlog_logger(fake: FakeRuntime) -> None:
    import logging

    with pytest.raises(pinpool.ConfigError, match="logger="):
        pinpool.PinnedPool(size=MiB, runtime=fake, logger=logging.getLogger("x"))


async def test_asgi_app_serves_the_pool_metrics(fake: FakeRuntime) -> None:
    from pinpool.metrics import make_asgi_app

    registry = CollectorRegistry()
    with pinpool.PinnedPool(size=MiB, runtime=fake, name="asgi", registry=registry):
        app = make_asgi_app(registry=registry)
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": "/", "query_string": b"", "headers": []}
        await app(scope, receive, send)
    assert sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    assert 'pinpool_pinned_bytes{pool="asgi",runtime="fake"} 1.048576e+06' in body


def test_an_unconfigured_application_sees_one_readable_line_per_warning() -> None:
    """No logging or structlog configuration at all (a plain script): a rollback is one line on
    stderr naming the pool and the cause, never a bare event name; INFO and DEBUG stay silent."""
    import sys

    code = (
        "import pinpool\n"
        "from pinpool.testing import FakeRuntime\n"
        "try:\n"
        "    with pinpool.PinnedPool(size='8MiB', chunk_bytes='1MiB', runtime=FakeRuntime(fail_register_on=3),\n"
        "                            registry=None, name='kv-host', max_retries=0):\n"
        "        pass\n"
        "except pinpool.PinError:\n"
        "    pass\n"
        "with pinpool.PinnedPool(size='8MiB', runtime=FakeRuntime(), registry=None, name='quiet'):\n"
        "    pass\n"
    )
    result = preloaded.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "pinpool: pool.rollback pool='kv-host' runtime='fake' layout='raw' cause='failure' registered_chunks=2"
    ], lines
    assert result.stdout == ""


def test_the_start_event_says_how_the_pin_workers_run() -> None:
    """pin_nice and the stall budget decide how a pin shares the host: the first event says both."""
    with structlog.testing.capture_logs() as logs:
        with pinpool.PinnedPool(size=4 * MiB, runtime=FakeRuntime(), name="fg", registry=None):
            pass
        with pinpool.PinnedPool(size=4 * MiB, runtime=FakeRuntime(), name="bg", registry=None, background=True):
            pass
    starts = {e["pool"]: e for e in logs if e["event"] == "pool.pin.start"}
    assert (starts["fg"]["pin_nice"], starts["fg"]["max_call_seconds"]) == (0, None)
    assert starts["bg"]["pin_nice"] == 10 and starts["bg"]["max_call_seconds"] > 0
    # And the CPU budget the worker counts were sized from: this host's, quota included.
    host = _probe.probe_host(torch_build=False)
    quota = None if host.cpu_quota is None else host.cpu_quota.cpus
    assert (starts["fg"]["cpu_budget"], starts["fg"]["cpu_quota"]) == (host.cpu_budget, quota)
