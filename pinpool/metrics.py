"""Prometheus metrics for pinpool, and helpers to expose them. Names and labels are a contract
(docs/metrics.md); created once per ``CollectorRegistry``, shared by its pools; a pool's gauge
series go with the last open pool of its labels."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, make_asgi_app, start_http_server

from ._errors import ConfigError

__all__ = ["POOL_BUCKETS", "REGISTER_BUCKETS", "PoolMetrics", "make_asgi_app", "metrics_for", "serve"]

# Exponential from 1 ms to 60 s: a registration holds the driver lock, so this range is the
# serving stall, from "unnoticeable" to "a request timed out".
REGISTER_BUCKETS = (*(0.001 * 2**k for k in range(16)), 60.0)
POOL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

_BASE = ("pool", "runtime")
_TRANSFER = (*_BASE, "registrar")  # a transfer registrar's families (pinpool.registrars): its name, never an offset

_CALL_OPS = ("register", "populate", "unregister")  # the ``op`` label of call_seconds_max
OTHER_REASON = "other"  # the ``reason`` label of chunk_failures for a reason not documented


def _multiprocess() -> bool:  # prometheus_client's multiprocess mode: a series cannot be removed there
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ or "prometheus_multiproc_dir" in os.environ


class PoolMetrics:
    """The metric families of one registry, and the open pools holding each label tuple's gauge series."""

    # The instance dict holds the metric families only (a failed __init__ unregisters all of it).
    __slots__ = ("__dict__", "_leaked", "_lock", "_open", "_registrars", "_transfer_leaked")

    def __init__(self, registry: CollectorRegistry) -> None:
        try:
            self._create(registry)
        except ValueError as exc:  # prometheus_client: "Duplicated timeseries in CollectorRegistry"
            # Leave the registry as it was, so fixing the clash and constructing again works.
            for collector in vars(self).values():
                registry.unregister(collector)
            raise ConfigError(
                f"registry={registry!r} already holds a collector with one of pinpool's metric names ({exc}); "
                "pass another registry, or registry=None"
            ) from exc
        self._lock = threading.Lock()
        self._open: dict[tuple[str, ...], int] = {}  # (pool, runtime), or pool_info's 5 labels -> open pools
        self._leaked: dict[tuple[str, ...], int] = {}  # (pool, runtime) -> bytes that may still be pinned
        self._registrars: dict[tuple[str, ...], set[str]] = {}  # (pool, runtime) -> registrars with gauge series
        self._transfer_leaked: set[tuple[str, ...]] = set()  # (pool, runtime, registrar): may still be registered

    def transfer_used(self, labels: tuple[str, ...], registrar: str) -> None:
        """An open pool with ``labels`` is about to set ``registrar``'s gauges: their series go with the last
        open pool of ``labels`` (a registrar's name is not known when the pool opens)."""
        with self._lock:
            self._registrars.setdefault(labels, set()).add(registrar)

    def pool_opened(self, labels: tuple[str, ...], info_labels: tuple[str, ...]) -> None:
        """A pool starts pinning: before its first gauge update (a closing namesake keeps off its series)."""
        with self._lock:
            for key in (labels, info_labels):
                self._open[key] = self._open.get(key, 0) + 1

    def _last_closed(self, key: tuple[str, ...]) -> bool:
        """Under the lock: one fewer open pool for ``key``; whether it was the last."""
        left = self._open.pop(key, 0) - 1
        if left > 0:
            self._open[key] = left
        return left <= 0

    def pool_closed(
        self, labels: tuple[str, ...], info_labels: tuple[str, ...], *, leaked_bytes: int = 0,
        transfer_leaked: Iterable[str] = (),
    ) -> None:  # fmt: skip
        """A pool closed, after its last gauge update: the last of its labels takes their series, except
        ``pinned_bytes`` while bytes with those labels may still be pinned (a failed unregistration), and a
        registrar's transfer gauges while a registration may still be live (``transfer_leaked``: their names)."""
        keep = _multiprocess()  # prometheus_client cannot remove a series there; livesum drops dead processes
        with self._lock:
            if leaked_bytes:
                self._leaked[labels] = self._leaked.get(labels, 0) + leaked_bytes
            self._transfer_leaked.update((*labels, registrar) for registrar in transfer_leaked)
            if self._last_closed(info_labels) and not keep:
                self.pool_info.remove(*info_labels)
            if not self._last_closed(labels) or keep:
                return
            for gauge in (
                self.pool_bytes, self.chunks_in_flight, self.pools_open, self.pools_ready, self.reserved_bytes,
                self.memory_pressure,
            ):  # fmt: skip
                gauge.remove(*labels)
            if labels not in self._leaked:
                self.pinned_bytes.remove(*labels)
            for op in _CALL_OPS:
                self.call_seconds_max.remove(*labels, op)
            for registrar in self._registrars.pop(labels, ()):
                if (*labels, registrar) not in self._transfer_leaked:
                    self.transfer_registrations.remove(*labels, registrar)
                    self.transfer_registered_bytes.remove(*labels, registrar)

    def _create(self, registry: CollectorRegistry) -> None:
        kw: dict[str, Any] = {"registry": registry}
        calls, pools = {"buckets": REGISTER_BUCKETS, **kw}, {"buckets": POOL_BUCKETS, **kw}
        live = {"multiprocess_mode": "livesum", **kw}
        self.chunk_register_seconds = Histogram(
            "pinpool_chunk_register_seconds", "Duration of one chunk's registration call (the driver-lock hold).",
            _BASE, **calls)  # fmt: skip
        self.chunk_unregister_seconds = Histogram(
            "pinpool_chunk_unregister_seconds", "Duration of one chunk's unregistration call.",
            _BASE, **calls)  # fmt: skip
        self.chunk_populate_seconds = Histogram(
            "pinpool_chunk_populate_seconds",
            "Duration of one populate call: pre-faulting one span (<= 512 MiB) of a chunk with MADV_POPULATE_WRITE.",
            _BASE, **calls)  # fmt: skip
        self.populated_bytes = Counter(
            "pinpool_populated_bytes_total", "Bytes pre-faulted by populate calls that succeeded.",
            _BASE, **kw)  # fmt: skip
        self.chunks_registered = Counter(
            "pinpool_chunks_registered_total", "Chunks registered successfully.", _BASE, **kw)  # fmt: skip
        self.registered_bytes = Counter("pinpool_registered_bytes_total", "Bytes registered successfully.", _BASE, **kw)
        self.chunk_failures = Counter(
            "pinpool_chunk_failures_total",
            "Failed runtime calls, by phase (populate, register, unregister) and reason.",
            (*_BASE, "phase", "reason"), **kw)  # fmt: skip
        self.rollbacks = Counter(
            "pinpool_rollbacks_total", "Pinnings rolled back, by cause (failure, cancelled).",
            (*_BASE, "cause"), **kw)  # fmt: skip
        self.retries = Counter("pinpool_retries_total", "Chunk registrations retried.", _BASE, **kw)
        self.released_elsewhere = Counter(
            "pinpool_released_elsewhere_total",
            "Registrations found already released by someone else when pinpool unregistered them (CUDA 713, "
            "HIP 1062): counted as unregistered, not as failures.", _BASE, **kw)  # fmt: skip
        self.log_errors = Counter(
            "pinpool_log_errors_total",
            "Log calls that raised (in a logger or structlog processor); swallowed, reported once per pool on stderr.",
            _BASE, **kw)  # fmt: skip
        self.pinned_bytes = Gauge("pinpool_pinned_bytes", "Bytes pinned now.", _BASE, **live)
        self.pool_bytes = Gauge("pinpool_pool_bytes", "Target size of open pools, in bytes.", _BASE, **live)
        self.chunks_in_flight = Gauge("pinpool_chunks_in_flight", "Runtime calls in progress.", _BASE, **live)
        self.call_seconds_max = Gauge(
            "pinpool_call_seconds_max",
            "Longest single runtime call of the pool's pinning or unpinning so far, by op (register, populate, "
            "unregister): the stall a serving process felt (see max_call_seconds).",
            (*_BASE, "op"), multiprocess_mode="livemax", **kw)  # fmt: skip
        self.node_wait_seconds = Histogram(
            "pinpool_node_wait_seconds",
            "Time a pool waited for node pacing before pinning, by kind (slot: a pinning slot; budget: a share "
            "of the host's byte budget).", (*_BASE, "kind"), **pools)  # fmt: skip
        self.node_busy = Counter(
            "pinpool_node_busy_total",
            "Pools refused at once by node pacing (node_wait=False), by kind (slots, budget).",
            (*_BASE, "kind"), **kw)  # fmt: skip
        self.pools_ready = Gauge(
            "pinpool_pools_ready", "Pools fully pinned now (a pool pinning in the background is open, not ready).",
            _BASE, **live)  # fmt: skip
        self.pools_open = Gauge("pinpool_pools_open", "Pools pinning or pinned now.", _BASE, **live)
        self.pool_pin_seconds = Histogram(
            "pinpool_pool_pin_seconds", "Duration of pinning a whole pool.", _BASE, **pools)  # fmt: skip
        self.pool_unpin_seconds = Histogram(
            "pinpool_pool_unpin_seconds", "Duration of unpinning a whole pool.", _BASE, **pools)  # fmt: skip
        self.pool_info = Gauge(
            "pinpool_pool_info", "Configuration of open pools (value 1).",
            (*_BASE, "layout", "granularity_bytes", "chunk_bytes"), multiprocess_mode="liveall", **kw)  # fmt: skip
        # Transfer registrars (pinpool.registrars): a second registration of the pool's memory, with an engine.
        self.transfer_registrations = Gauge(
            "pinpool_transfer_registrations",
            "Live registrations of pool memory with a transfer registrar (a transfer engine: Mooncake, NIXL, ...).",
            _TRANSFER, **live)  # fmt: skip
        self.transfer_registered_bytes = Gauge(
            "pinpool_transfer_registered_bytes", "Bytes of pool memory registered with a transfer registrar now.",
            _TRANSFER, **live)  # fmt: skip
        self.transfer_register_seconds = Histogram(
            "pinpool_transfer_register_seconds", "Duration of one registration call of a transfer registrar.",
            _TRANSFER, **calls)  # fmt: skip
        self.transfer_unregister_seconds = Histogram(
            "pinpool_transfer_unregister_seconds", "Duration of one unregistration call of a transfer registrar.",
            _TRANSFER, **calls)  # fmt: skip
        self.transfer_failures = Counter(
            "pinpool_transfer_failures_total",
            "Failed calls of a transfer registrar, by op (register, unregister) and reason.",
            (*_TRANSFER, "op", "reason"), **kw)  # fmt: skip
        # Elastic pools (reserve=; docs/elastic-design.md) and their policy loop (elastic=).
        self.reserved_bytes = Gauge(
            "pinpool_reserved_bytes", "Bytes elastic pools reserved: the most they may pin (their size= is the floor).",
            _BASE, **live)  # fmt: skip
        self.grows = Counter(
            "pinpool_grows_total", "Grows of an elastic pool, by outcome (grown, failed, cancelled, refused).",
            (*_BASE, "outcome"), **kw)  # fmt: skip
        self.grown_bytes = Counter(
            "pinpool_grown_bytes_total", "Bytes elastic pools pinned by growing (whole segments).", _BASE, **kw
        )
        self.shrinks = Counter(
            "pinpool_shrinks_total",
            "Shrinks of an elastic pool, by outcome (shrunk; kept: nothing named was a whole segment; declined: the "
            "server gave nothing up; failed, cancelled, refused).", (*_BASE, "outcome"), **kw)  # fmt: skip
        self.released_bytes = Counter(
            "pinpool_released_bytes_total", "Bytes elastic pools unpinned and gave back to the host by shrinking.",
            _BASE, **kw)  # fmt: skip
        self.shrink_seconds = Histogram(
            "pinpool_shrink_seconds",
            "Duration of a shrink, from its decision (the policy's, or the call) to the memory given back.",
            _BASE, **calls)  # fmt: skip
        self.memory_pressure = Gauge(
            "pinpool_memory_pressure_psi", "PSI memory some avg10 (percent), as an elastic pool's policy last read it.",
            _BASE, multiprocess_mode="livemax", **kw)  # fmt: skip
        self.pressure_events = Counter(
            "pinpool_pressure_events_total",
            "Memory pressure notifications an elastic pool's policy woke on, by source (psi, cgroup_v1).",
            (*_BASE, "source"), **kw)  # fmt: skip
        self.at_floor = Counter(
            "pinpool_elastic_at_floor_total",
            "Times an elastic pool's policy, under pressure, shrank to the floor or found it there: nothing more to "
            "give back.", _BASE, **kw)  # fmt: skip
        self.elastic_failures = Counter(
            "pinpool_elastic_failures_total",
            "Failures of an elastic pool's policy loop, by kind (read, grow, give_up, shrink): logged, never raised.",
            (*_BASE, "kind"), **kw)  # fmt: skip


_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, PoolMetrics] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def metrics_for(registry: CollectorRegistry) -> PoolMetrics:
    """The metric families registered in ``registry``, created on first use (so pools share them)."""
    with _lock:
        if (metrics := _by_registry.get(registry)) is None:
            metrics = _by_registry[registry] = PoolMetrics(registry)
        return metrics


def serve(port: int, addr: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY) -> Any:
    """Serve ``registry`` at ``http://addr:port/metrics`` from a daemon thread (loopback by default);
    returns ``start_http_server``'s result. ASGI: mount ``make_asgi_app(registry=...)`` instead."""
    return start_http_server(port, addr=addr, registry=registry)
