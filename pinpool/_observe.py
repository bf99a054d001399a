"""What a pool reports while it works: Prometheus metrics and structlog events, one method per transition.
No method of :class:`Observer` raises an ``Exception`` (a raising logger must never cost a chunk): as
``logging.Handler.handleError`` does, a failure is swallowed, counted and reported once per pool."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CollectorRegistry

from ._errors import RuntimeCallError, class_name, foreign_text
from .metrics import OTHER_REASON, PoolMetrics, metrics_for

if TYPE_CHECKING:
    from ._node.pacing import NodeHolder
    from ._plan.chunks import Chunk


def default_logger() -> Any:
    """structlog's logger if the application configured structlog, else stdlib's ``pinpool`` (all fields shown)."""
    if structlog.is_configured():
        return structlog.get_logger("pinpool")
    return structlog.wrap_logger(
        logging.getLogger("pinpool"),
        wrapper_class=structlog.stdlib.BoundLogger,
        processors=[structlog.stdlib.filter_by_level, _render_line_for_stdlib],
    )


def _render_line_for_stdlib(_logger: Any, _method: str, event_dict: Any) -> dict[str, Any]:
    """``pinpool: pool.rollback pool='kv' cause='failure' ...`` as the message, the fields as ``extra``."""
    kwargs = dict(structlog.stdlib.render_to_log_kwargs(_logger, _method, event_dict))
    fields = kwargs.get("extra", {})
    shown = " ".join(f"{key}={value!r}" for key, value in fields.items())
    kwargs["msg"] = f"pinpool: {kwargs.get('msg', '')} {shown}".rstrip()
    return kwargs


class Observer:
    """Metrics and logs of one pool (``registry=None``: no metrics). Only the constructor may raise."""

    def __init__(
        self, *, pool: str, runtime: str, layout: str, registry: CollectorRegistry | None, logger: Any | None,
        reasons: frozenset[str] = frozenset(),
    ) -> None:  # fmt: skip
        self.metrics: PoolMetrics | None = None if registry is None else metrics_for(registry)
        self._labels = (pool, runtime)
        self._layout = layout
        self._reasons = reasons  # the failure reasons a metric label may take; any other is OTHER_REASON
        self.log = (default_logger() if logger is None else logger).bind(pool=pool, runtime=runtime, layout=layout)
        self._info_labels: tuple[str, ...] | None = None
        # Per-chunk events are DEBUG: not built for a logger that drops them (they cost a tiny chunk's third).
        is_enabled_for = getattr(self.log, "isEnabledFor", None)
        self._chunk_debug = not callable(is_enabled_for) or bool(is_enabled_for(logging.DEBUG))
        self.log_errors = 0  # failures of the user's logger
        self.metric_errors = 0
        self._errors_lock = threading.Lock()  # taken only on a failure
        self._reported: set[str] = set()
        # Longest call per op, without a lock: a lost race only delays a larger value to the next call.
        self.longest: dict[str, float] = {"register": 0.0, "populate": 0.0, "unregister": 0.0}
        self._was_ready = False
        self._told_waiting = False
        # Transfer registrars' runs counted in their gauges now, (registrar, offset, nbytes) -> how many times:
        # an unregister moves the gauges only for a run counted (a "maybe registered" one was not), once each.
        self._transfer_live: dict[tuple[str, int, int], int] = {}
        self._transfer_lock = threading.Lock()
        self.reserved = 0  # an elastic pool's reservation in bytes (set before entry), in pinpool_reserved_bytes

    def _emit(self, level: str, event: str, **fields: Any) -> None:  # self.log.<level>(event, **fields)
        try:
            getattr(self.log, level)(event, **fields)
        except Exception as exc:
            self._log_failed(event, exc)

    def _log_failed(self, event: str, exc: Exception) -> None:
        self._metric("log_errors", lambda m: m.log_errors.labels(*self._labels).inc())
        self._failed("log", f"logging event {event!r} raised", exc)

    def _metric(self, what: str, *updates: Callable[[PoolMetrics], None]) -> None:
        if self.metrics:
            try:
                for update in updates:
                    update(self.metrics)
            except Exception as exc:
                self._metric_failed(what, exc)

    def _metric_failed(self, what: str, exc: Exception) -> None:
        self._failed("metrics", f"updating metrics ({what}) raised", exc)

    def _failed(self, kind: str, what: str, exc: Exception) -> None:
        """Count it; one line on ``sys.stderr`` for the first of a kind (not ``warnings``: a filter may raise)."""
        with self._errors_lock:
            if kind == "log":
                self.log_errors += 1
            else:
                self.metric_errors += 1
            if kind in self._reported:
                return
            self._reported.add(kind)
        stream = sys.stderr
        if stream is None:  # under pythonw, or at interpreter shutdown
            return
        counted = "Observer.log_errors and pinpool_log_errors_total" if kind == "log" else "Observer.metric_errors"
        with contextlib.suppress(Exception):  # a closed or broken stderr: nothing more can be done
            stream.write(
                f"pinpool: pool {self._labels[0]!r}: {what}: {class_name(exc)}: {foreign_text(exc)} "
                f"(ignored; reported once per pool, every failure is counted in {counted})\n"
            )
            stream.flush()

    def call_started(self) -> None:
        self._metric("call_started", lambda m: m.chunks_in_flight.labels(*self._labels).inc())

    def call_ended(self) -> None:
        self._metric("call_ended", lambda m: m.chunks_in_flight.labels(*self._labels).dec())

    def unregister_call_took(self, seconds: float) -> None:
        """One unregister call (of a piece): the longest-call gauge is about single calls, not chunks."""
        self._call_took("unregister", seconds)

    def _call_took(self, op: str, seconds: float) -> None:
        if seconds <= self.longest[op]:
            return
        self.longest[op] = seconds
        self._metric("call_seconds_max", lambda m: m.call_seconds_max.labels(*self._labels, op).set(seconds))

    def span_populated(self, nbytes: int, seconds: float) -> None:
        self._call_took("populate", seconds)
        self._metric(
            "span_populated",
            lambda m: m.chunk_populate_seconds.labels(*self._labels).observe(seconds),
            lambda m: m.populated_bytes.labels(*self._labels).inc(nbytes),
        )

    def chunk_registered(self, chunk: Chunk, seconds: float, attempt: int = 1) -> None:
        """A registration call returned (lock-on-fault: the chunk is pinned once faulted, see chunk_pinned)."""
        self._call_took("register", seconds)
        self._metric("chunk_registered", lambda m: m.chunk_register_seconds.labels(*self._labels).observe(seconds))
        if self._chunk_debug:
            self._emit(
                "debug", "chunk.registered", offset=chunk.offset, nbytes=chunk.nbytes, seconds=round(seconds, 6),
                attempt=attempt,
            )  # fmt: skip

    def chunk_failed(self, chunk: Chunk, phase: str, error: RuntimeCallError, seconds: float, attempt: int = 1) -> None:
        reason = error.reason if error.reason in self._reasons else OTHER_REASON  # bounded: one series each
        self._metric("chunk_failed", lambda m: m.chunk_failures.labels(*self._labels, phase, reason).inc())
        self._emit(
            "debug", "chunk.failed", offset=chunk.offset, nbytes=chunk.nbytes, seconds=round(seconds, 6),
            attempt=attempt, phase=phase, code=error.code, reason=error.reason, error=error.message,
        )  # fmt: skip

    def chunk_retried(self, chunk: Chunk, error: RuntimeCallError, halves: tuple[Chunk, Chunk], attempt: int) -> None:
        """A registration failed with a retryable code: ``chunk`` is retried as two aligned halves."""
        self._metric("chunk_retried", lambda m: m.retries.labels(*self._labels).inc())
        self._emit(
            "info", "chunk.retry", offset=chunk.offset, nbytes=chunk.nbytes, code=error.code, reason=error.reason,
            halves=[halves[0].nbytes, halves[1].nbytes], attempt=attempt,
        )  # fmt: skip

    def chunk_pinned(self, chunk: Chunk) -> None:  # registered and all its pages in: pinned whole
        self._metric(
            "chunk_pinned",
            lambda m: m.chunks_registered.labels(*self._labels).inc(),
            lambda m: m.registered_bytes.labels(*self._labels).inc(chunk.nbytes),
        )

    def pinned_moved(self, nbytes: int) -> None:
        """``pool.pinned_bytes`` moved by ``nbytes`` (negative: unpinned): the gauge follows the ledger's figure."""
        if nbytes:
            self._metric("pinned_moved", lambda m: m.pinned_bytes.labels(*self._labels).inc(nbytes))

    def chunk_unregistered(self, chunk: Chunk, seconds: float) -> None:
        """A chunk is unregistered (``seconds``: all its calls; see :meth:`unregister_call_took`)."""
        self._metric("chunk_unregistered", lambda m: m.chunk_unregister_seconds.labels(*self._labels).observe(seconds))

    def released_elsewhere(self, piece: Chunk, ptr: int, answer: RuntimeCallError) -> None:
        """Unregistering ``piece`` found no registration: someone else released it (a warning: perhaps in use)."""
        self._metric("released_elsewhere", lambda m: m.released_elsewhere.labels(*self._labels).inc())
        self._piece_event("warning", "chunk.released_elsewhere", piece, ptr, answer)

    def not_registered(self, piece: Chunk, ptr: int, answer: RuntimeCallError) -> None:
        """A "may be registered" ``piece`` is not: nothing to undo; logged next to its ``chunk.failed``."""
        self._piece_event("info", "chunk.not_registered", piece, ptr, answer)

    def registered_despite_code(self, piece: Chunk, ptr: int, error: RuntimeCallError) -> None:
        """A register that answered ``error`` had registered ``piece`` (a stale code): unregistered again."""
        self._piece_event("warning", "chunk.registered_despite_code", piece, ptr, error)

    # -- transfer registrars (pinpool.registrars): one event per registration call ------------------

    def _transfer_book(self, registrar: str, run: Chunk, step: int) -> int:
        """Move ``registrar``'s book of live runs by ``step`` (+1 registered, -1 unregistered); the bytes its
        gauges move by: 0 where no open pool counts it (an unregistered "maybe registered" run was never)."""
        key = (registrar, run.offset, run.nbytes)
        with self._transfer_lock:
            if self._info_labels is None:  # not between pin_started and unpinned: no gauge to move
                return 0
            held = self._transfer_live.get(key, 0)
            if step < 0 and held <= 0:
                return 0
            if held + step:
                self._transfer_live[key] = held + step
            else:
                del self._transfer_live[key]
        return step * run.nbytes

    def _transfer_gauges(self, m: PoolMetrics, registrar: str, moved: int) -> None:
        if moved:
            labels = (*self._labels, registrar)
            m.transfer_used(self._labels, registrar)  # before the series exist: they go with the pool's labels
            m.transfer_registrations.labels(*labels).inc(1 if moved > 0 else -1)
            m.transfer_registered_bytes.labels(*labels).inc(moved)

    def transfer_registered(self, registrar: str, run: Chunk, seconds: float) -> None:
        """``registrar`` registered ``run`` (bytes of the pool) in ``seconds``."""
        self._transfer_done("registered", registrar, run, seconds, +1)

    def transfer_failed(self, registrar: str, op: str, run: Chunk, error: RuntimeCallError, seconds: float) -> None:
        """``registrar``'s ``op`` ("register" or "unregister") of ``run`` failed. A failed unregister keeps
        ``run`` in the gauges: it may still be registered (and keeps their series past the pool's close)."""
        reason = error.reason if error.reason in self._reasons else OTHER_REASON  # bounded: one series each
        self._metric(
            "transfer_failed", lambda m: m.transfer_failures.labels(*self._labels, registrar, op, reason).inc()
        )
        self._emit(
            "warning", "transfer.failed", registrar=registrar, op=op, offset=run.offset, nbytes=run.nbytes,
            seconds=round(seconds, 6), code=error.code, reason=error.reason, error=error.message,
        )  # fmt: skip

    def transfer_unregistered(self, registrar: str, run: Chunk, seconds: float) -> None:
        """``registrar`` unregistered ``run`` in ``seconds`` (or found it not registered: nothing to undo)."""
        self._transfer_done("unregistered", registrar, run, seconds, -1)

    def _transfer_done(self, what: str, registrar: str, run: Chunk, seconds: float, sign: int) -> None:
        moved = self._transfer_book(registrar, run, sign)
        self._metric(
            f"transfer_{what}",
            lambda m: (
                (m.transfer_register_seconds if sign > 0 else m.transfer_unregister_seconds)
                .labels(*self._labels, registrar)
                .observe(seconds)
            ),
            lambda m: self._transfer_gauges(m, registrar, moved),
        )
        if self._chunk_debug:
            self._emit(
                "debug", f"transfer.{what}", registrar=registrar, offset=run.offset, nbytes=run.nbytes,
                seconds=round(seconds, 6),
            )  # fmt: skip

    def transfer_leaked(self) -> tuple[str, ...]:
        """The registrars with runs still counted live: a failed unregister left them maybe registered."""
        with self._transfer_lock:
            return tuple(sorted({registrar for registrar, _offset, _nbytes in self._transfer_live}))

    def _piece_event(self, level: str, event: str, piece: Chunk, ptr: int, answer: RuntimeCallError) -> None:
        self._emit(
            level, event, offset=piece.offset, nbytes=piece.nbytes, ptr=hex(ptr), code=answer.code, reason=answer.reason
        )

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
                if self.reserved:
                    m.reserved_bytes.labels(*labels).inc(self.reserved)
                    m.at_floor.labels(*labels)  # at 0, so the alert's increase() sees the first
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
        """Pinning ended before ready, for ``cause``; ``kept_bytes``: what a background pool keeps pinned until exit."""
        self._metric("rollback", lambda m: m.rollbacks.labels(*self._labels, cause).inc())
        level = "info" if cause == "exit" else "warning"
        fields: dict[str, Any] = {"cause": cause, "registered_chunks": registered_chunks}
        if kept_bytes:
            fields["kept_bytes"] = kept_bytes
        self._emit(level, "pool.rollback", **fields)

    def node_admitted(self, *, kind: str, seconds: float) -> None:
        self._metric("node_admitted", lambda m: m.node_wait_seconds.labels(*self._labels, kind).observe(seconds))
        self._emit("info" if seconds >= 1 else "debug", "node.admitted", kind=kind, seconds=round(seconds, 6))

    def node_busy(self, *, kind: str) -> None:  # node_wait=False
        self._metric("node_busy", lambda m: m.node_busy.labels(*self._labels, kind).inc())
        self._emit("warning", "node.busy", kind=kind)

    def node_waiting(self, kind: str, holders: Sequence[NodeHolder], waited_seconds: float) -> None:
        """Node pacing has kept the pool waiting (after 10 s, then every 60 s), and whom for."""
        described = [h.describe() for h in holders]
        self._emit("warning", "node.waiting", kind=kind, seconds=round(waited_seconds, 3), holders=described)

    def unpin_waiting(self, calls: Sequence[tuple[str, int, int, float]], abandon_after: int) -> None:
        """A Ctrl-C is held while teardown waits on its unpin threads: name the call in flight longest
        (``calls``: op, ptr, nbytes, perf_counter at its start), once per pool (it tears down once)."""
        if self._told_waiting:
            return
        self._told_waiting = True
        op, ptr, nbytes, started = min(calls, key=lambda c: c[3]) if calls else ("none", 0, 0, time.perf_counter())
        self._emit(
            "warning", "pool.unpin.waiting", op=op, ptr=hex(ptr), nbytes=nbytes, calls=len(calls),
            seconds=round(time.perf_counter() - started, 3), abandon_after=abandon_after,
        )  # fmt: skip

    def failed_in_background(self, error: BaseException) -> None:
        """Background pinning ended early; waiters raise ``error``; what is pinned stays until exit."""
        # A failure of on_progress is the user's exception: its text may raise, or be any length.
        self._emit("error", "pool.failed", error=foreign_text(error, limit=4000), error_type=class_name(error))

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
                    if self.reserved:
                        m.reserved_bytes.labels(*labels).dec(self.reserved)
                    if self._info_labels is not None:
                        m.pool_info.labels(*self._info_labels).dec()
                finally:  # whatever failed above, the pool's series go with the last open pool of its labels
                    with self._transfer_lock:  # no transfer gauge moves once the pool's series may be gone
                        info_labels, self._info_labels = self._info_labels, None
                    if info_labels is not None:  # pin_started took them
                        m.pool_closed(
                            labels, info_labels, leaked_bytes=leaked_bytes, transfer_leaked=self.transfer_leaked()
                        )
            except Exception as exc:
                self._metric_failed("unpinned", exc)
        if failures:
            self._emit(
                "error", "pool.unpin.failed", failures=failures, leaked_bytes=leaked_bytes, seconds=round(seconds, 6)
            )
        elif pinned:  # after a rollback, pool.rollback already told the story
            self._emit("info", "pool.unpinned", bytes=nbytes, seconds=round(seconds, 6))

    # -- an elastic pool: its grows and shrinks, and its policy loop (pinpool._pool.follow) ----------

    def grew(self, outcome: str, nbytes: int, seconds: float, **fields: Any) -> None:
        """A grow ended: ``outcome`` grown, failed, cancelled or refused; ``nbytes`` pinned by it."""
        self._metric(
            "grew",
            lambda m: m.grows.labels(*self._labels, outcome).inc(),
            lambda m: m.grown_bytes.labels(*self._labels).inc(nbytes),
        )
        level = "info" if outcome == "grown" else "warning"
        self._emit(level, "pool.grow", outcome=outcome, bytes=nbytes, seconds=round(seconds, 6), **fields)

    def shrank(self, outcome: str, nbytes: int, seconds: float, **fields: Any) -> None:
        """A shrink ended: ``outcome`` shrunk, kept, declined, failed, cancelled or refused; ``nbytes`` given back;
        ``seconds`` from its decision to the memory given back."""
        self._metric(
            "shrank",
            lambda m: m.shrinks.labels(*self._labels, outcome).inc(),
            lambda m: m.shrink_seconds.labels(*self._labels).observe(seconds) if nbytes else None,
        )
        level = "info" if outcome in ("shrunk", "kept", "declined") else "warning"
        self._emit(level, "pool.shrink", outcome=outcome, bytes=nbytes, seconds=round(seconds, 6), **fields)

    def gave_back(self, nbytes: int) -> None:
        """A released segment's pages went back to the host: counted once, whichever shrink gave them back (one
        that finished a segment an earlier shrink's failed teardown left behind, too)."""
        self._metric("gave_back", lambda m: m.released_bytes.labels(*self._labels).inc(nbytes))

    def kept_in_region(self, pages: range, nbytes: int) -> None:
        """A shrink unpinned ``pages`` of a shared region but left them in its file: another process maps it."""
        self._emit(
            "warning", "pool.shrink.kept_in_region", pages=f"[{pages.start}, {pages.stop})", bytes=nbytes,
            reason="another process maps the region: its pool may have these pages pinned and in use",
        )  # fmt: skip

    def pressure_read(self, psi_some_avg10: float | None) -> None:
        if psi_some_avg10 is not None:
            self._metric("pressure_read", lambda m: m.memory_pressure.labels(*self._labels).set(psi_some_avg10))

    def pressure_woke(self, source: str) -> None:
        self._metric("pressure_woke", lambda m: m.pressure_events.labels(*self._labels, source).inc())

    def elastic_event(self, level: str, event: str, **fields: Any) -> None:
        """One of the policy loop's own events (``elastic.*``): started, decided, stopped."""
        self._emit(level, event, **fields)

    def at_floor(self, reason: str) -> None:
        """Under pressure with nothing left to give back (it shrank to the floor, or was there)."""
        self._metric("at_floor", lambda m: m.at_floor.labels(*self._labels).inc())
        self._emit("warning", "elastic.at_floor", reason=reason)

    def elastic_failed(self, kind: str, error: BaseException, **fields: Any) -> None:
        """The policy loop's ``kind`` step (read, grow, give_up, shrink) raised ``error``: counted and logged."""
        self._metric("elastic_failed", lambda m: m.elastic_failures.labels(*self._labels, kind).inc())
        self._emit(
            "error", "elastic.failed", kind=kind, error=foreign_text(error, limit=2000), error_type=class_name(error),
            **fields,
        )  # fmt: skip
