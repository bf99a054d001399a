"""Issue 9: a user's logger, structlog processor or a metrics call can never make an Observer
method raise an ``Exception``, on whichever thread it runs. Failures are counted
(``Observer.log_errors``, ``pinpool_log_errors_total``) and reported once per pool on stderr,
like ``logging.Handler.handleError``; a ``KeyboardInterrupt`` still propagates."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry

import pinpool
from pinpool._errors import RuntimeCallError
from pinpool._observe import Observer
from pinpool._plan import Chunk
from pinpool._ranges import PINNED_RANGES
from pinpool.metrics import PoolMetrics
from pinpool.testing import FakeRuntime

MiB = 1 << 20
LEVELS = ("debug", "info", "warning", "error")


class RaisingLogger:
    """A bound logger whose log methods raise ``exc`` (``bind`` works, so construction succeeds)."""

    def __init__(self, exc: BaseException, levels: tuple[str, ...] = LEVELS) -> None:
        self.exc = exc
        self.levels = levels
        self.calls: list[str] = []

    def bind(self, **_: Any) -> RaisingLogger:
        return self

    def _call(self, level: str, event: str, **_: Any) -> None:
        self.calls.append(event)
        if level in self.levels:
            raise self.exc

    def debug(self, event: str, **kw: Any) -> None:
        self._call("debug", event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        self._call("info", event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._call("warning", event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._call("error", event, **kw)


def raising_processor_logger() -> Any:
    """A real structlog logger whose (user) processor raises on every event."""

    def processor(_logger: Any, _name: str, event: Any) -> Any:
        raise LookupError(f"processor broke on {event['event']}")

    return structlog.wrap_logger(structlog.testing.CapturingLogger(), processors=[processor])


def chunk(index: int = 0) -> Chunk:
    return Chunk(offset=index * MiB, nbytes=MiB)


def error() -> RuntimeCallError:
    return RuntimeCallError(
        op="register", code=2, reason="cudaErrorMemoryAllocation", message="out of memory", ptr=0, nbytes=MiB
    )


PIN_STARTED: dict[str, Any] = {
    "nbytes": 4 * MiB, "chunks": 4, "chunk_bytes": MiB, "granularity": None, "order": "populate_first",
    "register_workers": 1, "populate_workers": 1,
}  # fmt: skip
UNPINNED: dict[str, Any] = {"nbytes": 4 * MiB, "seconds": 0.01, "pinned": True}

# Every public method of Observer, with arguments; the order is a pool's life.
CALLS: list[tuple[str, Callable[[Observer], None]]] = [
    ("pin_started", lambda o: o.pin_started(**PIN_STARTED)),
    ("call_started", lambda o: o.call_started()),
    ("span_populated", lambda o: o.span_populated(MiB, 0.001)),
    ("chunk_registered", lambda o: o.chunk_registered(chunk(), 0.001)),
    ("chunk_pinned", lambda o: o.chunk_pinned(chunk())),
    ("pinned_moved", lambda o: o.pinned_moved(MiB)),
    ("chunk_failed", lambda o: o.chunk_failed(chunk(1), "register", error(), 0.001)),
    ("call_ended", lambda o: o.call_ended()),
    ("rollback", lambda o: o.rollback(cause="failure", registered_chunks=1)),
    ("pinned", lambda o: o.pinned(nbytes=4 * MiB, chunks=4, seconds=0.01)),
    ("transfer_registered", lambda o: o.transfer_registered("engine", chunk(), 0.001)),
    ("transfer_failed", lambda o: o.transfer_failed("engine", "register", chunk(1), error(), 0.001)),
    ("transfer_unregistered", lambda o: o.transfer_unregistered("engine", chunk(), 0.001)),
    ("chunk_unregistered", lambda o: o.chunk_unregistered(chunk(), 0.001)),
    ("pinned_moved (unpinned)", lambda o: o.pinned_moved(-MiB)),
    ("unregister_call_took", lambda o: o.unregister_call_took(0.001)),
    ("unpinned", lambda o: o.unpinned(**UNPINNED, failures=0, leaked_bytes=0)),
    ("unpinned (failed)", lambda o: o.unpinned(**UNPINNED, failures=1, leaked_bytes=MiB)),
]
# The calls that emit a log event (chunk_registered only when debug is enabled, as it is here).
LOGGING = {"pin_started", "chunk_registered", "chunk_failed", "rollback", "pinned", "unpinned", "unpinned (failed)",
           "transfer_registered", "transfer_failed", "transfer_unregistered"}  # fmt: skip


def observer(logger: Any, registry: CollectorRegistry | None = None, pool: str = "safe") -> Observer:
    return Observer(pool=pool, runtime="fake", layout="raw", registry=registry, logger=logger)


def log_errors(registry: CollectorRegistry, pool: str = "safe") -> float | None:
    return registry.get_sample_value("pinpool_log_errors_total", {"pool": pool, "runtime": "fake"})


def report_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("pinpool: ")]


@pytest.mark.parametrize("logger", [RaisingLogger(ValueError("logger down")), raising_processor_logger()],
                         ids=["logger", "processor"])  # fmt: skip
def test_no_method_raises_and_the_failure_is_reported_once(logger: Any, capsys: pytest.CaptureFixture[str]) -> None:
    registry = CollectorRegistry()
    obs = observer(logger, registry)
    for _name, call in CALLS:
        call(obs)  # must not raise
    assert obs.log_errors == len(LOGGING)
    assert obs.metric_errors == 0
    assert log_errors(registry) == len(LOGGING)
    lines = report_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    (line,) = lines
    assert "'safe'" in line and "'pool.pin.start'" in line  # the pool, and the first event that failed
    assert ("ValueError: logger down" in line) or ("LookupError: processor broke on pool.pin.start" in line), line
    # The rest of the metrics still work.
    assert registry.get_sample_value("pinpool_chunks_registered_total", {"pool": "safe", "runtime": "fake"}) == 1


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_is_contained(level: str, capsys: pytest.CaptureFixture[str]) -> None:
    logger = RaisingLogger(RuntimeError(f"{level} broke"), levels=(level,))
    obs = observer(logger)
    for _name, call in CALLS:
        call(obs)
    expected = {"debug": 4, "info": 3, "warning": 2, "error": 1}[level]  # transfer.registered, .unregistered: debug
    assert obs.log_errors == expected
    lines = report_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"RuntimeError: {level} broke" in lines[0], lines


def test_reported_once_per_pool(capsys: pytest.CaptureFixture[str]) -> None:
    logger = RaisingLogger(ValueError("down"))
    first, second = observer(logger, pool="first"), observer(logger, pool="second")
    for obs in (first, second, first, second):
        obs.rollback(cause="failure", registered_chunks=0)
    lines = report_lines(capsys.readouterr().err)
    assert len(lines) == 2, lines
    assert "'first'" in lines[0] and "'second'" in lines[1]
    assert all("'pool.rollback'" in line for line in lines)
    assert first.log_errors == second.log_errors == 2


def test_worker_threads_count_every_failure_and_report_once(capsys: pytest.CaptureFixture[str]) -> None:
    registry = CollectorRegistry()
    obs = observer(RaisingLogger(ValueError("down")), registry)
    escaped: list[BaseException] = []

    def worker() -> None:
        try:
            for i in range(200):
                obs.call_started()
                obs.chunk_registered(chunk(i), 0.001)
                obs.chunk_pinned(chunk(i))
                obs.call_ended()
        except BaseException as exc:
            escaped.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert escaped == []
    assert obs.log_errors == 8 * 200
    assert log_errors(registry) == 8 * 200
    assert registry.get_sample_value("pinpool_chunks_registered_total", {"pool": "safe", "runtime": "fake"}) == 1600
    assert registry.get_sample_value("pinpool_chunks_in_flight", {"pool": "safe", "runtime": "fake"}) == 0
    assert len(report_lines(capsys.readouterr().err)) == 1


def test_keyboard_interrupt_from_the_logger_propagates(capsys: pytest.CaptureFixture[str]) -> None:
    obs = observer(RaisingLogger(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        obs.pin_started(**PIN_STARTED)
    with pytest.raises(KeyboardInterrupt):
        obs.rollback(cause="cancelled", registered_chunks=0)
    assert obs.log_errors == 0
    assert report_lines(capsys.readouterr().err) == []


def test_a_disabled_debug_level_is_still_skipped() -> None:
    """The cheap DEBUG skip stays: a stdlib-backed logger at INFO never builds chunk.registered."""
    import logging

    calls: list[str] = []

    class InfoOnly(RaisingLogger):
        def isEnabledFor(self, level: int) -> bool:
            return level >= logging.INFO

    logger = InfoOnly(ValueError("down"), levels=())
    logger.calls = calls
    obs = observer(logger)
    obs.chunk_registered(chunk(), 0.001)
    assert calls == []


class BrokenMetric:
    def labels(self, *_: str) -> Any:
        raise OSError(28, "No space left on device")  # e.g. a multiprocess-mode file that cannot grow


def test_metrics_failures_are_contained_and_reported_once(capsys: pytest.CaptureFixture[str]) -> None:
    registry = CollectorRegistry()
    obs = observer(structlog.wrap_logger(structlog.testing.CapturingLogger()), registry)
    assert obs.metrics is not None
    for name in list(vars(obs.metrics)):
        setattr(obs.metrics, name, BrokenMetric())
    for _name, call in CALLS:
        call(obs)
    # Every metrics block failed once; the two calls that time a register or populate call also
    # fail to raise the longest-call gauge (pinpool_call_seconds_max), in a block of their own
    # (unregister calls raise it through unregister_call_took, which has no other block).
    assert obs.metric_errors == len(CALLS) + len({"span_populated", "chunk_registered"})
    assert obs.log_errors == 0
    lines = report_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "'safe'" in lines[0] and "OSError" in lines[0] and "pin_started" in lines[0], lines


def test_a_broken_stderr_does_not_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    class Closed:
        def write(self, _: str) -> int:
            raise ValueError("I/O operation on closed file")

        def flush(self) -> None:
            raise ValueError("I/O operation on closed file")

    monkeypatch.setattr("sys.stderr", Closed())
    obs = observer(RaisingLogger(ValueError("down")))
    obs.rollback(cause="failure", registered_chunks=0)
    monkeypatch.setattr("sys.stderr", None)
    other = observer(RaisingLogger(ValueError("down")))
    other.rollback(cause="failure", registered_chunks=0)
    assert obs.log_errors == other.log_errors == 1


def test_an_unprintable_exception_is_still_reported(capsys: pytest.CaptureFixture[str]) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no str")

    obs = observer(RaisingLogger(Unprintable()))
    obs.rollback(cause="failure", registered_chunks=0)
    (line,) = report_lines(capsys.readouterr().err)
    assert "Unprintable: <Unprintable whose str raised RuntimeError>" in line  # pinpool's one foreign_text


def test_log_errors_series_exists_at_zero_once_pinning_starts() -> None:
    registry = CollectorRegistry()
    obs = observer(structlog.wrap_logger(structlog.testing.CapturingLogger()), registry)
    assert log_errors(registry) is None
    CALLS[0][1](obs)
    assert log_errors(registry) == 0


def test_a_clashing_registry_is_a_config_error_and_leaves_the_registry_as_it_was(fake: FakeRuntime) -> None:
    from prometheus_client import Gauge

    registry = CollectorRegistry()
    clash = Gauge("pinpool_pinned_bytes", "someone else's", registry=registry)
    with pytest.raises(pinpool.ConfigError, match="pinpool_pinned_bytes"):
        PoolMetrics(registry)
    # Only the clashing collector is left; after removing it, pinpool's metrics can be created.
    assert {name for name in registry._names_to_collectors if name.startswith("pinpool_")} == {"pinpool_pinned_bytes"}
    registry.unregister(clash)
    PoolMetrics(registry)
    with pytest.raises(pinpool.ConfigError):
        pinpool.PinnedPool(size=MiB, runtime=fake, registry=_clashing_registry())


def _clashing_registry() -> CollectorRegistry:
    from prometheus_client import Counter

    registry = CollectorRegistry()
    Counter("pinpool_log_errors_total", "someone else's", registry=registry)
    return registry


# -- end to end: a real pool whose logger raises on every call --------------------------------------


def raising_logger() -> RaisingLogger:
    return RaisingLogger(ValueError("logger down"))


def test_a_pool_with_a_raising_logger_pins_and_unpins(fake: FakeRuntime, capsys: pytest.CaptureFixture[str]) -> None:
    before = PINNED_RANGES.snapshot()
    registry = CollectorRegistry()
    logger = raising_logger()
    pool = pinpool.PinnedPool(size="64MiB", chunk_bytes="4MiB", runtime=fake, logger=logger, registry=registry)
    with pool:
        assert pool.pinned_bytes == 64 * MiB
    assert fake.registered == {}
    labels = {"pool": pool.name, "runtime": "fake"}
    assert registry.get_sample_value("pinpool_pinned_bytes", labels) is None  # a closed pool's gauges go
    assert registry.get_sample_value("pinpool_chunks_registered_total", labels) == 16
    assert registry.get_sample_value("pinpool_log_errors_total", labels) == len(logger.calls) >= 3
    assert len(report_lines(capsys.readouterr().err)) == 1
    assert PINNED_RANGES.snapshot() == before  # the process-wide range claim was released


def test_a_pool_whose_logger_raises_only_at_start_and_end_releases_its_claim(fake: FakeRuntime) -> None:
    before = PINNED_RANGES.snapshot()
    logger = RaisingLogger(ValueError("logger down"), levels=("info",))
    with pinpool.PinnedPool(size="64MiB", chunk_bytes="4MiB", runtime=fake, logger=logger, registry=None):
        pass
    assert fake.registered == {}
    assert PINNED_RANGES.snapshot() == before
