"""What a pool reports while it works: Prometheus metrics and structlog events, in one place.

The engine and drivers call one method per transition; this module decides what each means
for metrics and logs. Worker threads call the chunk methods (prometheus_client and structlog's
sync methods are thread-safe); never the async logging methods, which break under trio.

No method of :class:`Observer` raises an ``Exception``, whatever the user's logger, its
processors or the metrics do: the engine calls them between recording outcomes, and a raising
logger must never cost a chunk or a range claim. Like ``logging.Handler.handleError``, a failed
log call is swallowed, counted (``Observer.log_errors``, ``pinpool_log_errors_total``) and
reported once per pool, as one line on ``sys.stderr``; a failed metrics call likewise
(``Observer.metric_errors``). A ``BaseException`` that is not an ``Exception``
(``KeyboardInterrupt``, ``SystemExit``) propagates, on whichever thread it was raised.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CollectorRegistry

from ._errors import RuntimeCallError
from .metrics import PoolMetrics, metrics_for

if TYPE_CHECKING:
    from ._node.pacing import NodeHolder
    from ._plan.chunks import Chunk


def default_logger() -> Any:
    """structlog's logger where the application configured structlog; otherwise one that goes
    through the stdlib ``pinpool`` logger, so an unconfigured application sees no per-chunk
    lines (structlog's own unconfigured default prints every level to stdout), and what it does
    see (WARNING and above, through logging's last-resort handler) is one readable line with the
    pool, the cause and every field, never a bare event name. The fields also go to ``extra``
    for handlers that format records themselves."""
    if structlog.is_configured():
        return structlog.get_logger("pinpool")
    return structlog.wrap_logger(
        logging.getLogger("pinpool"),
        wrapper_class=structlog.stdlib.BoundLogger,
        processors=[structlog.stdlib.filter_by_level, _render_line_for_stdlib],
    )


def _render_line_for_stdlib(_logger: Any, _method: str, event_dict: Any) -> dict[str, Any]:
    """``pinpool: pool.rollback pool='kv' runtime='mlock' cause='failure' registered_chunks=3``
    as the record's message, the fields as its ``extra`` (structlog's render_to_log_kwargs shape)."""
    kwargs = dict(structlog.stdlib.render_to_log_kwargs(_logger, _method, event_dict))
    fields = kwargs.get("extra", {})
    shown = " ".join(f"{key}={value!r}" for key, value in fields.items())
    kwargs["msg"] = f"pinpool: {kwargs.get('msg', '')} {shown}".rstrip()
    return kwargs


class Observer:
    """Metrics and logs of one pool. ``registry=None`` disables metrics.

    The constructor may raise (``ConfigError`` for a registry that clashes, or whatever the
    logger's ``bind`` raises); no other method raises an ``Exception`` (see the module doc).
    """

    def __init__(
        self, *, pool: str, runtime: str, layout: str, registry: CollectorRegistry | None, logger: Any | None
    ) -> None:
        self.metrics: PoolMetrics | None = None if registry is None else metrics_for(registry)
        self._pool = pool
        self._labels = (pool, runtime)
        self._layout = layout
        self.log = (default_logger() if logger is None else logger).bind(pool=pool, runtime=runtime, layout=layout)
        self._info_labels: tuple[str, ...] | None = None
        # Per-chunk events are DEBUG; skip building them when the logger would drop them anyway
        # (structlog's processing of a filtered event is a third of a tiny chunk's cost).
        is_enabled_for = getattr(self.log, "isEnabledFor", None)
        self._chunk_debug = not callable(is_enabled_for) or bool(is_enabled_for(logging.DEBUG))
        # Failures of the user's logger and of metrics calls: counted, reported once each.
        # The lock is taken only on a failure, never on the hot path.
        self.log_errors = 0
        self.metric_errors = 0
        self._errors_lock = threading.Lock()
        self._reported: set[str] = set()
        # Longest call per op; updated without a lock (a lost race only delays a larger value
        # to the next call, and the gauge is set from the local value each time it grows).
        self.longest: dict[str, float] = {"register": 0.0, "populate": 0.0, "unregister": 0.0}
        self._was_ready = False

    # -- failure containment -------------------------------------------------------------------

    def _emit(self, level: str, event: str, **fields: Any) -> None:
        """``self.log.<level>(event, **fields)``; an ``Exception`` from it is counted and reported, never raised."""
        try:
            getattr(self.log, level)(event, **fields)
        except Exception as exc:
            self._log_failed(event, exc)

    def _log_failed(self, event: str, exc: Exception) -> None:
        with self._errors_lock:
            self.log_errors += 1
        if self.metrics:
            try:
                self.metrics.log_errors.labels(*self._labels).inc()
            except Exception as metric_exc:
                self._metric_failed("log_errors", metric_exc)
        self._report_once("log", f"logging event {event!r} raised", exc)

    def _metric_failed(self, what: str, exc: Exception) -> None:
        with self._errors_lock:
            self.metric_errors += 1
        self._report_once("metrics", f"updating metrics ({what}) raised", exc)

    def _report_once(self, kind: str, what: str, exc: Exception) -> None:
        """One line on ``sys.stderr`` for the first failure of this kind in this pool, as
        ``logging.Handler.handleError`` reports (not ``warnings``: a filter may turn it into an error)."""
        with self._errors_lock:
            if kind in self._reported:
                return
            self._reported.add(kind)
        try:
            try:
                message = f"{type(exc).__name__}: {exc}"
            except Exception:
                message = f"{type(exc).__name__}: <unprintable>"
            stream = sys.stderr
            if stream is not None:  # None under pythonw, or at interpreter shutdown
                counted = (
                    "Observer.log_errors and pinpool_log_errors_total" if kind == "log" else "Observer.metric_errors"
                )
                stream.write(
                    f"pinpool: pool {self._pool!r}: {what}: {message} "
                    f"(ignored; reported once per pool, every failure is counted in {counted})\n"
                )
                stream.flush()
        except Exception:
            pass  # a closed or broken stderr: nothing more can be done, and raising is not allowed

    # -- chunks (worker threads) -------------------------------------------------------------

    def call_started(self) -> None:
        if self.metrics:
            try:
                self.metrics.chunks_in_flight.labels(*self._labels).inc()
            except Exception as exc:
                self._metric_failed("call_started", exc)

    def call_ended(self) -> None:
        if self.metrics:
            try:
                self.metrics.chunks_in_flight.labels(*self._labels).dec()
            except Exception as exc:
                self._metric_failed("call_ended", exc)

    def unregister_call_took(self, seconds: float) -> None:
        """One unregister call ended: a chunk registered in pieces is unregistered one call per
        piece, and the longest-call gauge is about single calls (the stall), not chunks."""
        self._call_took("unregister", seconds)

    def _call_took(self, op: str, seconds: float) -> None:
        if seconds <= self.longest[op]:
            return
        self.longest[op] = seconds
        if self.metrics:
            try:
                self.metrics.call_seconds_max.labels(*self._labels, op).set(seconds)
            except Exception as exc:
                self._metric_failed("call_seconds_max", exc)

    def span_populated(self, nbytes: int, seconds: float) -> None:
        self._call_took("populate", seconds)
        if self.metrics:
            try:
                self.metrics.chunk_populate_seconds.labels(*self._labels).observe(seconds)
                self.metrics.populated_bytes.labels(*self._labels).inc(nbytes)
            except Exception as exc:
                self._metric_failed("span_populated", exc)

    def chunk_registered(self, chunk: Chunk, seconds: float, attempt: int = 1) -> None:
        """A registration call returned (lock-on-fault: the chunk is pinned once faulted, see chunk_pinned)."""
        self._call_took("register", seconds)
        if self.metrics:
            try:
                self.metrics.chunk_register_seconds.labels(*self._labels).observe(seconds)
            except Exception as exc:
                self._metric_failed("chunk_registered", exc)
        if self._chunk_debug:
            self._emit(
                "debug", "chunk.registered", offset=chunk.offset, nbytes=chunk.nbytes, seconds=round(seconds, 6),
                attempt=attempt,
            )  # fmt: skip

    def chunk_failed(self, chunk: Chunk, phase: str, error: RuntimeCallError, seconds: float, attempt: int = 1) -> None:
        if self.metrics:
            try:
                self.metrics.chunk_failures.labels(*self._labels, phase, error.reason).inc()
            except Exception as exc:
                self._metric_failed("chunk_failed", exc)
        self._emit(
            "debug", "chunk.failed", offset=chunk.offset, nbytes=chunk.nbytes, seconds=round(seconds, 6),
            attempt=attempt, phase=phase, code=error.code, reason=error.reason, error=error.message,
        )  # fmt: skip

    def chunk_retried(self, chunk: Chunk, error: RuntimeCallError, halves: tuple[Chunk, Chunk], attempt: int) -> None:
        """A registration failed with a retryable code: ``chunk`` is retried as two aligned halves."""
        if self.metrics:
            try:
                self.metrics.retries.labels(*self._labels).inc()
            except Exception as exc:
                self._metric_failed("chunk_retried", exc)
        self._emit(
            "info", "chunk.retry", offset=chunk.offset, nbytes=chunk.nbytes, code=error.code, reason=error.reason,
            halves=[halves[0].nbytes, halves[1].nbytes], attempt=attempt,
        )  # fmt: skip

    def chunk_pinned(self, chunk: Chunk) -> None:
        """A chunk is registered and all its pages are in: it counts as pinned whole."""
        if self.metrics:
            m, labels = self.metrics, self._labels
            try:
                m.chunks_registered.labels(*labels).inc()
                m.registered_bytes.labels(*labels).inc(chunk.nbytes)
            except Exception as exc:
                self._metric_failed("chunk_pinned", exc)

    def pinned_moved(self, nbytes: int) -> None:
        """``pool.pinned_bytes`` moved by ``nbytes`` (negative: unpinned): the gauge follows the
        ledger's one figure, piece by piece and span by span, so the two never disagree."""
        if self.metrics and nbytes:
            try:
                self.metrics.pinned_bytes.labels(*self._labels).inc(nbytes)
            except Exception as exc:
                self._metric_failed("pinned_moved", exc)

    def chunk_unregistered(self, chunk: Chunk, seconds: float) -> None:
        """A chunk is unregistered (``seconds``: all its calls; see :meth:`unregister_call_took`)."""
        if self.metrics:
            try:
                self.metrics.chunk_unregister_seconds.labels(*self._labels).observe(seconds)
            except Exception as exc:
                self._metric_failed("chunk_unregistered", exc)

    def released_elsewhere(self, piece: Chunk, ptr: int, answer: RuntimeCallError) -> None:
        """Unregistering ``piece`` (at address ``ptr``) found no registration there: someone else
        released it (a server's own clean-up). Not a failure; worth a warning, since that clean-up
        also undid pinning pinpool owned, perhaps while the pool was still in use."""
        if self.metrics:
            try:
                self.metrics.released_elsewhere.labels(*self._labels).inc()
            except Exception as exc:
                self._metric_failed("released_elsewhere", exc)
        self._emit(
            "warning", "chunk.released_elsewhere", offset=piece.offset, nbytes=piece.nbytes, ptr=hex(ptr),
            code=answer.code, reason=answer.reason,
        )  # fmt: skip

    def not_registered(self, piece: Chunk, ptr: int, answer: RuntimeCallError) -> None:
        """``piece`` only may have been registered (its register call failed untrusted) and the
        runtime says it is not: that call never registered it. Nothing to undo, nothing leaked;
        logged so the runtime's misbehaviour is on record next to its ``chunk.failed``."""
        self._emit(
            "info", "chunk.not_registered", offset=piece.offset, nbytes=piece.nbytes, ptr=hex(ptr),
            code=answer.code, reason=answer.reason,
        )  # fmt: skip

    # -- the pool (event loop / calling thread) ----------------------------------------------------

    def pin_started(
        self, *, nbytes: int, chunks: int, chunk_bytes: int, granularity: int | None, order: str,
        register_workers: int, populate_workers: int, pin_nice: int = 0, max_call_seconds: float | None = None,
        budget_yields_to: str | None = None, cpu_budget: int | None = None, cpu_quota: float | None = None,
        duty_cycle: float = 1.0,
    ) -> None:  # fmt: skip
        if self.metrics:
            m, labels = self.metrics, self._labels
            try:
                info_labels = (*labels, self._layout, str(granularity or 0), str(chunk_bytes))
                m.pool_opened(labels, info_labels)  # before the first gauge update: the series are held
                self._info_labels = info_labels
                m.pools_open.labels(*labels).inc()
                m.pool_bytes.labels(*labels).inc(nbytes)
                m.pool_info.labels(*info_labels).inc()
                m.log_errors.labels(*labels)  # the series exists at 0, so increase() sees the first error
            except Exception as exc:
                self._metric_failed("pin_started", exc)
        self._emit(
            "info", "pool.pin.start", bytes=nbytes, chunks=chunks, chunk_bytes=chunk_bytes,
            granularity_bytes=granularity, order=order, register_workers=register_workers,
            populate_workers=populate_workers, pin_nice=pin_nice, max_call_seconds=max_call_seconds,
            budget_yields_to=budget_yields_to, cpu_budget=cpu_budget, cpu_quota=cpu_quota, duty_cycle=duty_cycle,
        )  # fmt: skip

    def pinned(self, *, nbytes: int, chunks: int, seconds: float) -> None:
        if self.metrics:
            try:
                self.metrics.pool_pin_seconds.labels(*self._labels).observe(seconds)
                self.metrics.pools_ready.labels(*self._labels).inc()
                self._was_ready = True
            except Exception as exc:
                self._metric_failed("pinned", exc)
        gbps = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
        self._emit(
            "info", "pool.pinned", bytes=nbytes, chunks=chunks, seconds=round(seconds, 6), gb_per_s=round(gbps, 3)
        )

    def rollback(self, *, cause: str, registered_chunks: int, kept_bytes: int = 0) -> None:
        """Pinning ended before the pool was ready, for ``cause`` (failure, cancelled, exit,
        collected: see ``_outcome.Outcome``). ``kept_bytes``: what a background pool keeps pinned
        until it is exited (its body may be using it); the rest is rolled back now. Only a
        failure is a warning: an exit during a background pin is a normal shutdown."""
        if self.metrics:
            try:
                self.metrics.rollbacks.labels(*self._labels, cause).inc()
            except Exception as exc:
                self._metric_failed("rollback", exc)
        level = "info" if cause == "exit" else "warning"
        fields: dict[str, Any] = {"cause": cause, "registered_chunks": registered_chunks}
        if kept_bytes:
            fields["kept_bytes"] = kept_bytes
        self._emit(level, "pool.rollback", **fields)

    def node_admitted(self, *, kind: str, seconds: float) -> None:
        """Node pacing admitted the pool after ``seconds`` of waiting (kind: slot or budget)."""
        if self.metrics:
            try:
                self.metrics.node_wait_seconds.labels(*self._labels, kind).observe(seconds)
            except Exception as exc:
                self._metric_failed("node_admitted", exc)
        self._emit("info" if seconds >= 1 else "debug", "node.admitted", kind=kind, seconds=round(seconds, 6))

    def node_busy(self, *, kind: str) -> None:
        """Node pacing refused the pool at once (node_wait=False)."""
        if self.metrics:
            try:
                self.metrics.node_busy.labels(*self._labels, kind).inc()
            except Exception as exc:
                self._metric_failed("node_busy", exc)
        self._emit("warning", "node.busy", kind=kind)

    def node_waiting(self, kind: str, holders: Sequence[NodeHolder], waited_seconds: float) -> None:
        """Node pacing has kept the pool waiting ``waited_seconds`` (after 10 s, then every 60 s):
        whom for, each ``NodeHolder.describe()``d with its state (``[stopped]``: SIGSTOPped)."""
        described = [h.describe() for h in holders]
        self._emit("warning", "node.waiting", kind=kind, seconds=round(waited_seconds, 3), holders=described)

    def failed_in_background(self, error: BaseException) -> None:
        """Pinning in the background ended early; waiters will raise ``error``. What was pinned
        stays pinned until the pool is exited."""
        self._emit("error", "pool.failed", error=str(error), error_type=type(error).__name__)

    def _release_series(self, metrics: PoolMetrics, leaked_bytes: int) -> None:
        """After the pool's last gauge update: its gauge series go with the last open pool of its labels."""
        info_labels, self._info_labels = self._info_labels, None
        if info_labels is not None:  # pin_started took them
            metrics.pool_closed(self._labels, info_labels, leaked_bytes=leaked_bytes)

    def unpinned(self, *, nbytes: int, seconds: float, failures: int, leaked_bytes: int, pinned: bool) -> None:
        if self.metrics:
            m, labels = self.metrics, self._labels
            try:
                try:
                    if pinned:
                        m.pool_unpin_seconds.labels(*labels).observe(seconds)
                    m.pools_open.labels(*labels).dec()
                    if self._was_ready:
                        m.pools_ready.labels(*labels).dec()
                        self._was_ready = False
                    m.pool_bytes.labels(*labels).dec(nbytes)
                    if self._info_labels is not None:
                        m.pool_info.labels(*self._info_labels).dec()
                finally:  # whatever failed above, the pool no longer holds its series
                    self._release_series(m, leaked_bytes)
            except Exception as exc:
                self._metric_failed("unpinned", exc)
        if failures:
            self._emit(
                "error", "pool.unpin.failed", failures=failures, leaked_bytes=leaked_bytes, seconds=round(seconds, 6)
            )
        elif pinned:  # after a rollback, pool.rollback already told the story
            self._emit("info", "pool.unpinned", bytes=nbytes, seconds=round(seconds, 6))
