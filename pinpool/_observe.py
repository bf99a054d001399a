"""What a pool reports while it works: Prometheus metrics and structlog events, in one place.

The engine and drivers call one method per transition; this module decides what each means
for metrics and logs. Worker threads call the chunk methods (prometheus_client and structlog's
sync methods are thread-safe); never the async logging methods, which break under trio.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from ._errors import RuntimeCallError
from ._plan import Chunk
from .metrics import PoolMetrics, metrics_for


def default_logger() -> Any:
    """structlog's logger where the application configured structlog; otherwise one that goes
    through the stdlib ``pinpool`` logger, so an unconfigured application sees no per-chunk
    lines (structlog's own unconfigured default prints every level to stdout)."""
    if structlog.is_configured():
        return structlog.get_logger("pinpool")
    return structlog.wrap_logger(
        logging.getLogger("pinpool"),
        wrapper_class=structlog.stdlib.BoundLogger,
        processors=[structlog.stdlib.filter_by_level, structlog.stdlib.render_to_log_kwargs],
    )


class Observer:
    """Metrics and logs of one pool. ``registry=None`` disables metrics."""

    def __init__(
        self, *, pool: str, runtime: str, layout: str, registry: CollectorRegistry | None, logger: Any | None
    ) -> None:
        self.metrics: PoolMetrics | None = None if registry is None else metrics_for(registry)
        self._labels = (pool, runtime)
        self._layout = layout
        self.log = (default_logger() if logger is None else logger).bind(pool=pool, runtime=runtime, layout=layout)
        self._info_labels: tuple[str, ...] | None = None
        # Per-chunk events are DEBUG; skip building them when the logger would drop them anyway
        # (structlog's processing of a filtered event is a third of a tiny chunk's cost).
        is_enabled_for = getattr(self.log, "isEnabledFor", None)
        self._chunk_debug = not callable(is_enabled_for) or bool(is_enabled_for(logging.DEBUG))

    # -- chunks (worker threads) -------------------------------------------------------------

    def call_started(self) -> None:
        if self.metrics:
            self.metrics.chunks_in_flight.labels(*self._labels).inc()

    def call_ended(self) -> None:
        if self.metrics:
            self.metrics.chunks_in_flight.labels(*self._labels).dec()

    def span_populated(self, nbytes: int, seconds: float) -> None:
        if self.metrics:
            self.metrics.chunk_populate_seconds.labels(*self._labels).observe(seconds)
            self.metrics.populated_bytes.labels(*self._labels).inc(nbytes)

    def chunk_registered(self, chunk: Chunk, seconds: float, attempt: int = 1) -> None:
        """A registration call returned (lock-on-fault: the chunk is pinned once faulted, see chunk_pinned)."""
        if self.metrics:
            self.metrics.chunk_register_seconds.labels(*self._labels).observe(seconds)
        if self._chunk_debug:
            self.log.debug(
                "chunk.registered", offset=chunk.offset, nbytes=chunk.nbytes, seconds=round(seconds, 6), attempt=attempt
            )

    def chunk_failed(self, chunk: Chunk, phase: str, error: RuntimeCallError, seconds: float, attempt: int = 1) -> None:
        if self.metrics:
            self.metrics.chunk_failures.labels(*self._labels, phase, error.reason).inc()
        self.log.debug(
            "chunk.failed", offset=chunk.offset, nbytes=chunk.nbytes, seconds=round(seconds, 6), attempt=attempt,
            phase=phase, code=error.code, reason=error.reason, error=error.message,
        )  # fmt: skip

    def chunk_pinned(self, chunk: Chunk) -> None:
        """A chunk is registered and all its pages are in: it counts as pinned."""
        if self.metrics:
            m, labels = self.metrics, self._labels
            m.chunks_registered.labels(*labels).inc()
            m.registered_bytes.labels(*labels).inc(chunk.nbytes)
            m.pinned_bytes.labels(*labels).inc(chunk.nbytes)

    def chunk_unregistered(self, chunk: Chunk, seconds: float, *, was_pinned: bool) -> None:
        if self.metrics:
            self.metrics.chunk_unregister_seconds.labels(*self._labels).observe(seconds)
            if was_pinned:
                self.metrics.pinned_bytes.labels(*self._labels).dec(chunk.nbytes)

    # -- the pool (event loop / calling thread) ----------------------------------------------------

    def pin_started(
        self, *, nbytes: int, chunks: int, chunk_bytes: int, granularity: int | None, order: str,
        register_workers: int, populate_workers: int,
    ) -> None:  # fmt: skip
        if self.metrics:
            m, labels = self.metrics, self._labels
            m.pools_open.labels(*labels).inc()
            m.pool_bytes.labels(*labels).inc(nbytes)
            self._info_labels = (*labels, self._layout, str(granularity or 0), str(chunk_bytes))
            m.pool_info.labels(*self._info_labels).inc()
        self.log.info(
            "pool.pin.start", bytes=nbytes, chunks=chunks, chunk_bytes=chunk_bytes, granularity_bytes=granularity,
            order=order, register_workers=register_workers, populate_workers=populate_workers,
        )  # fmt: skip

    def pinned(self, *, nbytes: int, chunks: int, seconds: float) -> None:
        if self.metrics:
            self.metrics.pool_pin_seconds.labels(*self._labels).observe(seconds)
        gbps = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
        self.log.info("pool.pinned", bytes=nbytes, chunks=chunks, seconds=round(seconds, 6), gb_per_s=round(gbps, 3))

    def rollback(self, *, cause: str, registered_chunks: int) -> None:
        if self.metrics:
            self.metrics.rollbacks.labels(*self._labels, cause).inc()
        self.log.warning("pool.rollback", cause=cause, registered_chunks=registered_chunks)

    def unpinned(self, *, nbytes: int, seconds: float, failures: int, leaked_bytes: int, pinned: bool) -> None:
        if self.metrics:
            m, labels = self.metrics, self._labels
            if pinned:
                m.pool_unpin_seconds.labels(*labels).observe(seconds)
            m.pools_open.labels(*labels).dec()
            m.pool_bytes.labels(*labels).dec(nbytes)
            if self._info_labels is not None:
                m.pool_info.labels(*self._info_labels).dec()
        if failures:
            self.log.error("pool.unpin.failed", failures=failures, leaked_bytes=leaked_bytes, seconds=round(seconds, 6))
        elif pinned:  # after a rollback, pool.rollback already told the story
            self.log.info("pool.unpinned", bytes=nbytes, seconds=round(seconds, 6))
