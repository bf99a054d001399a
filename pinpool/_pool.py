"""PinnedPool: the async and sync drivers around the pure plan and ledger.

The drivers decide nothing themselves: the plan says what to register, the ledger says
what has been registered and what to undo, and the engine's worker bodies do the calls.
What the drivers add is waiting: on worker threads, in a way that notices cancellation
(anyio cancel scopes, asyncio task cancellation, trio, KeyboardInterrupt) while the
threads run, stops them after their current chunk, and rolls back shielded.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from types import MappingProxyType, TracebackType
from typing import Any, NoReturn, TypeVar

import anyio
import anyio.lowlevel
import torch
from prometheus_client import REGISTRY, CollectorRegistry

from . import _libc
from ._engine import PinSession
from ._errors import (
    AlreadyPinnedError,
    ChunkFailure,
    ConfigError,
    PinError,
    PoolStateError,
    UnclosedPoolWarning,
    UnpinError,
)
from ._ledger import Phase, StopCause
from ._memory import (
    HostMapping,
    TensorMemory,
    check_huge_pages_available,
    check_hugetlb_available,
    check_numa_node,
)
from ._observe import Observer
from ._pipeline import Order
from ._plan import Chunk, ChunkPlan, plan_chunks, resolve_chunk_limit
from ._ranges import PINNED_RANGES
from ._threads import PROGRESS_INTERVAL_SECONDS, Threads
from ._units import format_bytes, parse_size
from .layouts import BufferSpec, Layout, Raw
from .runtimes import Runtime, resolve_runtime

T = TypeVar("T")

MAX_DEFAULT_WORKERS = 8
MAX_DEFAULT_POPULATE_WORKERS = 16
# With several workers, chunks are split further so each worker gets a few of them (and the
# pipeline has chunks to overlap), but never below this: smaller chunks only add calls, and
# the reference plans stay as they are.
MIN_PARALLEL_CHUNK_BYTES = 1 << 30
CHUNKS_PER_WORKER = 4
# One populate call faults at most this much, so mmap_lock is never held long (a registration
# or munmap elsewhere in the process waits for it), and every populate worker has spans to take.
MAX_SPAN_BYTES = 512 << 20
MIN_SPAN_BYTES = 16 << 20
MIN_BYTES_PER_DEFAULT_WORKER = 256 << 20

ProgressCallback = Callable[[int, int, int, int], object]


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def default_register_workers(runtime: Runtime) -> int:
    """CUDA serialises registration in the driver, so one; mlock (and the fake) scale with
    cores, up to a bound."""
    if runtime.name == "cuda":
        return 1
    return max(1, min(MAX_DEFAULT_WORKERS, available_cpus()))


def default_populate_workers() -> int:
    """Page faulting scales across cores."""
    return max(1, min(MAX_DEFAULT_POPULATE_WORKERS, available_cpus()))


def default_unpin_workers() -> int:
    """Unregistering scales across threads for CUDA too (Mooncake: 500 GB in 1.5 s on threads, 11.8 s in one)."""
    return max(1, min(MAX_DEFAULT_WORKERS, available_cpus()))


def _check_workers(option: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{option}={value!r} must be a positive int (or None for the default)")


def _span_bytes(chunk_bytes: int, populate_workers: int, align: int) -> int:
    share = -(-chunk_bytes // max(1, populate_workers))
    span = min(MAX_SPAN_BYTES, max(MIN_SPAN_BYTES, share))
    return -(-span // align) * align


def _parallel_limit(limit: int, nbytes: int, workers: int) -> int:
    if workers <= 1:
        return limit
    share = -(-nbytes // (workers * CHUNKS_PER_WORKER))
    return min(limit, max(MIN_PARALLEL_CHUNK_BYTES, share))


class _Buffer:
    """Where one layout buffer sits in the pool's mapping, and how it is chunked."""

    def __init__(self, spec: BufferSpec, offset: int, plan: ChunkPlan | None) -> None:
        self.spec = spec
        self.offset = offset
        self.plan = plan  # None for a zero-byte buffer: nothing to register

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        if self.plan is None:
            return ()
        return tuple(Chunk(self.offset + c.offset, c.nbytes) for c in self.plan.chunks)


class PinnedPool:
    """A page-locked host-memory pool, pinned in granularity-aligned chunks on worker threads.

    Use it once, as ``async with PinnedPool(...) as pool:`` or ``with PinnedPool(...) as pool:``.
    Everything is validated in the constructor (:class:`ConfigError`), before any memory is
    mapped or pinned. Inside the block ``pool.tensor`` is a zero-copy torch view of the pinned
    memory; on exit every chunk is unregistered, whatever the block did.

    Options:
      layout: what the memory holds (default :class:`pinpool.layouts.Raw`).
      size: byte budget, int or string (``"64GiB"``); the pool holds the largest whole number of
        layout pages that fits.
      runtime: ``"auto"`` (CUDA if available, else mlock), ``"cuda"``, ``"mlock"`` or a runtime object.
      chunk_bytes: the size of one registration call (rounded down to the layout's granularity).
        Without it, the limit is ``PINPOOL_REGISTER_CHUNK_GB`` GiB (else 256 GiB), and with
        several workers chunks are split further (not below 1 GiB) so every worker has a few.
      populate: pre-fault the memory on ``populate_workers`` threads (MADV_POPULATE_WRITE, in
        spans of <= 512 MiB), pipelined with registration. Default: on where the kernel has
        MADV_POPULATE_WRITE (Linux 5.14+). CUDA: spans are faulted ahead of the serial
        registrations (at most a couple of chunks ahead); mlock: each chunk is locked
        on-fault first, so faulting it also locks it.
      populate_workers: pre-fault threads (default: CPUs, up to 16).
      register_workers: registration threads (default: 1 for CUDA, whose driver serialises
        registration; CPUs up to 8 otherwise).
      unpin_workers: unregistration threads at exit and rollback (default: CPUs, up to 8).
      huge_pages: ``True``: 2 MiB-aligned memory with MADV_HUGEPAGE (transparent huge pages);
        ``"hugetlb"``: 2 MiB pages from the hugetlb pool (vm.nr_hugepages must have enough free).
      numa_node: bind the memory to this NUMA node (mbind) before any of it is faulted.
      name: the pool's name in logs, metrics and errors.
    """

    def __init__(
        self,
        *,
        layout: Layout | None = None,
        size: int | str,
        runtime: str | Runtime = "auto",
        chunk_bytes: int | str | None = None,
        populate: bool | None = None,
        populate_workers: int | None = None,
        register_workers: int | None = None,
        unpin_workers: int | None = None,
        huge_pages: bool | str = False,
        numa_node: int | None = None,
        name: str = "default",
        registry: CollectorRegistry | None = REGISTRY,
        logger: Any | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        self._configure(
            layout=layout, size=size, runtime=runtime, chunk_bytes=chunk_bytes, populate=populate,
            populate_workers=populate_workers, register_workers=register_workers, unpin_workers=unpin_workers,
            huge_pages=huge_pages, numa_node=numa_node, name=name, source=None, registry=registry, logger=logger,
            on_progress=on_progress,
        )  # fmt: skip

    def _configure(
        self,
        *,
        layout: Layout | None,
        size: int | str,
        runtime: str | Runtime,
        chunk_bytes: int | str | None,
        populate: bool | None,
        populate_workers: int | None,
        register_workers: int | None,
        unpin_workers: int | None,
        huge_pages: bool | str,
        numa_node: int | None,
        name: str,
        source: torch.Tensor | None,
        registry: CollectorRegistry | None,
        logger: Any | None,
        on_progress: ProgressCallback | None,
    ) -> None:
        """Validate and plan; ``source`` is a caller's tensor to pin instead of own memory (pin())."""
        self.layout: Layout = Raw() if layout is None else layout
        if not isinstance(self.layout, Layout):
            raise ConfigError(f"layout={layout!r} is not a layout; use one from pinpool.layouts, e.g. layouts.Raw()")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"name={name!r} must be a non-empty str (it labels the pool's logs and metrics)")
        if populate is not None and not isinstance(populate, bool):
            raise ConfigError(f"populate={populate!r} must be True, False or None (the default: on where supported)")
        if huge_pages not in (False, True, "hugetlb") or not isinstance(huge_pages, bool | str):
            raise ConfigError(
                f"huge_pages={huge_pages!r} must be False, True (transparent huge pages) or 'hugetlb' "
                "(pages reserved in vm.nr_hugepages)"
            )
        for option, value in (
            ("populate_workers", populate_workers), ("register_workers", register_workers),
            ("unpin_workers", unpin_workers),
        ):  # fmt: skip
            _check_workers(option, value)
        check_numa_node(numa_node)
        if huge_pages is True:
            check_huge_pages_available()
        self.runtime: Runtime = resolve_runtime(runtime)
        faults_itself = callable(getattr(self.runtime, "populate", None))  # e.g. FakeRuntime: touches nothing
        if populate is None:
            populate = faults_itself or _libc.populate_write_supported()
        elif populate and not faults_itself and not _libc.populate_write_supported():
            raise ConfigError(
                "populate=True needs MADV_POPULATE_WRITE (Linux 5.14 or newer), which this kernel rejects; "
                "use populate=False (registration then faults the pages itself)"
            )
        self.name = name
        self.populate = populate
        self.huge_pages: bool | str = huge_pages
        self.numa_node = numa_node
        budget = parse_size(size, what="size")
        limit = resolve_chunk_limit(chunk_bytes)
        self.chunk_limit = limit
        page_bytes = self.layout.page_bytes
        # A pool must hold at least one page, and one copy page of every buffer.
        smallest = max([page_bytes, *(s.granularity or 0 for s in self.layout.buffers(1))])
        if budget < smallest:
            raise ConfigError(
                f"size={size!r} ({budget} B) is smaller than one page of layout {self.layout.name!r} "
                f"({smallest} B = {format_bytes(smallest)}); give a size of at least {smallest} bytes"
            )
        self.num_pages = budget // page_bytes
        self.page_bytes = page_bytes
        # Lock-on-fault then fault is one pass over 4 KiB pages, but on huge pages the kernel's
        # on-fault locking is several times slower than faulting first and locking after
        # (measured: 2.5 vs 21 GB/s on THP), so huge pages are faulted first.
        if not populate:
            self.order = Order.REGISTER_ONLY
        elif callable(getattr(self.runtime, "lock_on_fault", None)) and not huge_pages:
            self.order = Order.REGISTER_FIRST
        else:
            self.order = Order.POPULATE_FIRST
        specs = self.layout.buffers(self.num_pages)
        total = sum(spec.nbytes for spec in specs)
        # Default worker counts shrink for small pools: below ~256 MiB a worker saves little
        # time and costs a thread start and contention for the GIL.
        by_size = max(1, total // MIN_BYTES_PER_DEFAULT_WORKER)
        wanted_register = register_workers or min(by_size, default_register_workers(self.runtime))
        wanted_populate = (populate_workers or min(by_size, default_populate_workers())) if populate else 0

        align = _libc.HUGE_PAGE_SIZE if huge_pages else _libc.PAGE_SIZE
        # An explicit chunk_bytes= is the chunk size; the default (or the environment's) is an
        # upper bound that is split further so the workers have chunks to share and overlap.
        workers = max(wanted_register, wanted_populate)
        split_limit = limit if chunk_bytes is not None else _parallel_limit(limit, total, workers)
        buffers: list[_Buffer] = []
        offset = 0
        start = 0 if source is None else source.data_ptr() % _libc.PAGE_SIZE  # own memory is page-aligned
        for spec in specs:
            plan = None
            if spec.nbytes:
                # The split for workers applies only where an aligned unit fits in it.
                unit = math.lcm(spec.granularity or 1, _libc.PAGE_SIZE)
                plan_limit = split_limit if split_limit >= unit else limit
                plan = plan_chunks(
                    spec.nbytes, granularity=spec.granularity, limit=plan_limit, page_size=_libc.PAGE_SIZE, start=start
                )
            buffers.append(_Buffer(spec, offset, plan))
            offset += -(-spec.nbytes // align) * align
        self._buffers = tuple(buffers)
        self._mapping_bytes = max(offset, _libc.PAGE_SIZE)
        self.chunks: tuple[Chunk, ...] = tuple(c for b in buffers for c in b.chunks)
        self.nbytes = total
        self.chunk_bytes = max((b.plan.chunk_bytes for b in buffers if b.plan), default=0)
        granularities = {b.spec.granularity for b in buffers if b.plan}
        self.granularity: int | None = granularities.pop() if len(granularities) == 1 else None
        self.register_workers = max(1, min(wanted_register, len(self.chunks)))
        self.span_bytes = _span_bytes(self.chunk_bytes, wanted_populate, align) if populate else 0
        spans = sum(-(-c.nbytes // self.span_bytes) for c in self.chunks) if populate else 0
        self.populate_workers = min(wanted_populate, spans)
        self.unpin_workers = max(1, min(unpin_workers or default_unpin_workers(), len(self.chunks)))
        # Workers take either role. Faulting first (CUDA), registration is the serial bottleneck,
        # so it gets threads of its own; registering first (mlock on-fault) or not faulting, a
        # registration is quick or is the fault, so the roles share threads.
        if self.order is Order.POPULATE_FIRST:
            self.threads = self.populate_workers + self.register_workers
        else:
            self.threads = max(self.populate_workers, self.register_workers)
        # Faulting may run this far ahead of registration (whole chunks; the front chunk always may).
        self.lookahead_bytes = max(2 * self.chunk_bytes, self.populate_workers * self.span_bytes)
        if huge_pages == "hugetlb":
            check_hugetlb_available(self._mapping_bytes)
        self._state = "new"
        self._session: PinSession | None = None
        self._mapping: HostMapping | TensorMemory | None = None
        self._source = source
        if registry is not None and not isinstance(registry, CollectorRegistry):
            raise ConfigError(f"registry={registry!r} must be a prometheus_client CollectorRegistry, or None")
        if logger is not None and not callable(getattr(logger, "bind", None)):
            raise ConfigError(
                f"logger={logger!r} must be a structlog (bound) logger with .bind(); "
                "wrap a stdlib logger with structlog.wrap_logger or structlog.stdlib.get_logger"
            )
        if on_progress is not None and not callable(on_progress):
            raise ConfigError(f"on_progress={on_progress!r} must be callable(pinned, total, done, chunks)")
        self.on_progress = on_progress
        self._observer = Observer(
            pool=name, runtime=self.runtime.name, layout=self.layout.name, registry=registry, logger=logger
        )
        self._tensors: Mapping[str, torch.Tensor] | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._exit_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"<PinnedPool {self.name!r} {self._state} {format_bytes(self.nbytes)} layout={self.layout.name} "
            f"runtime={self.runtime.name} chunks={len(self.chunks)}x<={format_bytes(self.chunk_bytes)} "
            f"order={self.order.value} workers=populate:{self.populate_workers},register:{self.register_workers}>"
        )

    # -- what users read ---------------------------------------------------------------------

    def _require_open(self, what: str) -> None:
        if self._state != "open":
            hint = (
                "enter it first (async with / with)"
                if self._state == "new"
                else "it was exited and unpinned; create a new pool"
            )
            raise PoolStateError(f"pool {self.name!r}.{what} is only available while the pool is open: {hint}")

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Buffer name → zero-copy tensor over the pinned memory, shaped by the layout."""
        self._require_open("tensors")
        assert self._tensors is not None
        return self._tensors

    @property
    def tensor(self) -> torch.Tensor:
        """The pool's tensor, for single-buffer layouts."""
        tensors = self.tensors
        if len(tensors) != 1:
            raise PoolStateError(f"layout {self.layout.name!r} has buffers {list(tensors)}: use pool.tensors[name]")
        return next(iter(tensors.values()))

    @property
    def data_ptr(self) -> int:
        """Base address of the pool's memory."""
        self._require_open("data_ptr")
        assert self._mapping is not None
        return self._mapping.address

    @property
    def pinned_bytes(self) -> int:
        """Bytes registered right now (0 before entering and after exit)."""
        session = self._session
        return 0 if session is None else session.ledger.registered_bytes

    @property
    def pin_seconds(self) -> float:
        """Wall time the last pinning took."""
        return 0.0 if self._session is None else self._session.pin_seconds

    @property
    def unpin_seconds(self) -> float:
        return 0.0 if self._session is None else self._session.unpin_seconds

    # -- shared by both drivers ----------------------------------------------------------------

    def _note_rollback(self, session: PinSession) -> None:
        ledger = session.ledger
        cause = StopCause.CANCELLED if ledger.stop_cause is StopCause.CANCELLED else StopCause.FAILURE
        self._observer.rollback(cause=cause.value, registered_chunks=ledger.chunks_done)

    def _report_progress(self, session: PinSession) -> None:
        if self.on_progress is not None:
            ledger = session.ledger
            self.on_progress(ledger.registered_bytes, self.nbytes, ledger.chunks_done, len(self.chunks))

    def _open(self) -> PinSession:
        if self._state != "new":
            raise PoolStateError(
                f"pool {self.name!r} is {self._state}: a PinnedPool is entered once; "
                "create a new PinnedPool to pin again"
            )
        self._state = "pinning"
        try:
            mapping = self._acquire_memory()
        except BaseException:
            self._state = "closed"
            raise
        session = PinSession(
            chunks=self.chunks,
            runtime=self.runtime,
            base_ptr=mapping.address,
            order=self.order,
            span_bytes=self.span_bytes or 1,
            lookahead_bytes=self.lookahead_bytes,
            register_workers=self.register_workers,
            populate_workers=self.populate_workers,
            unpin_workers=self.unpin_workers,
            observer=self._observer,
        )
        self._observer.pin_started(
            nbytes=self.nbytes, chunks=len(self.chunks), chunk_bytes=self.chunk_bytes,
            granularity=self.granularity, order=self.order.value, register_workers=self.register_workers,
            populate_workers=self.populate_workers,
        )  # fmt: skip
        self._mapping = mapping
        self._session = session
        self._finalizer = weakref.finalize(self, _finalize_unclosed, self.name, self.nbytes, session, mapping)
        return session

    def _acquire_memory(self) -> HostMapping | TensorMemory:
        """Map the pool's memory (or take the caller's tensor) and claim its range in this process."""
        if self._source is None:
            mapping: HostMapping | TensorMemory = HostMapping(
                self._mapping_bytes, huge_pages=self.huge_pages, numa_node=self.numa_node
            )
        else:
            mapping = TensorMemory(self._source)
        overlap = PINNED_RANGES.add(mapping.address, max(self.nbytes, 1))
        if overlap is not None:
            raise AlreadyPinnedError(
                f"pool {self.name!r}: [{mapping.address:#x}, +{self.nbytes}) overlaps "
                f"[{overlap[0]:#x}, +{overlap[1]}), which pinpool already pins in this process; "
                "nothing was pinned. Exit the other pool first, or pin a different tensor"
            )
        find_pinned = getattr(self.runtime, "find_pinned", None)
        elsewhere = find_pinned(mapping.address, self.nbytes) if callable(find_pinned) else None
        if elsewhere is not None:
            PINNED_RANGES.pop(mapping.address)
            raise AlreadyPinnedError(
                f"pool {self.name!r}: the memory is already pinned outside pinpool ({elsewhere}); "
                "nothing was pinned. Unpin it first, or pin a different tensor"
            )
        return mapping

    def _after_pinning(self, session: PinSession) -> None:
        """Workers are done: either the pool is pinned, or a chunk failed and the caller rolls back."""
        phase = session.finish_pinning()
        self._report_progress(session)
        if phase is Phase.PINNED:
            self._observer.pinned(nbytes=self.nbytes, chunks=len(self.chunks), seconds=session.pin_seconds)
            assert self._mapping is not None
            self._tensors = MappingProxyType(
                {
                    b.spec.name: self._mapping.view(b.offset, b.spec.nbytes).view(b.spec.dtype).view(b.spec.shape)
                    for b in self._buffers
                }
            )
            self._state = "open"
            return
        # Only a failure ends pinning without an exception already in flight.
        assert session.ledger.stop_cause is StopCause.FAILURE

    def _raise_pin_error(self, session: PinSession) -> NoReturn:
        failures = session.ledger.failures_in("populate", "register")
        leaked = session.ledger.leaked()
        first = min(failures, key=lambda f: f.chunk.offset)
        message = (
            f"pinning pool {self.name!r} ({format_bytes(self.nbytes)}, {len(self.chunks)} chunks of <= "
            f"{format_bytes(self.chunk_bytes)}, runtime {self.runtime.name}) failed at offset={first.chunk.offset} "
            f"nbytes={first.chunk.nbytes} total={self.nbytes} chunk_limit={self.chunk_limit}: {first.phase} "
            f"rc={first.error.code} ({first.error.reason}): {first.error.message}"
        )
        failed_chunks = len({f.chunk for f in failures})
        if len(failures) > 1:
            message += f" [{len(failures)} calls failed, in {failed_chunks} chunk(s)]"
        message += (
            f"; rolled back, {len(leaked)} chunk(s) could not be unregistered and may still be pinned: {leaked}"
            if leaked
            else "; every registered chunk was rolled back"
        )
        raise PinError(message, failures=failures, leaked=leaked) from first.error

    def _finish_close(
        self,
        session: PinSession,
        failures: tuple[ChunkFailure, ...],
        body_error: BaseException | None,
        *,
        rolled_back: bool = False,
    ) -> None:
        """Close the books after teardown. After a rollback, unpin failures are reported by the
        PinError (its ``leaked``) that follows, so they are logged and counted but not raised here."""
        mapping = self._mapping
        was_open = self._state == "closing"
        self._state = "closed"
        self._tensors = None
        self._mapping = None
        if self._finalizer is not None:
            self._finalizer.detach()
        assert mapping is not None  # _open maps before any teardown can happen
        leaked = _release(session, mapping, nbytes=self.nbytes, failures=failures, pinned=was_open)
        if not failures or rolled_back:
            return
        error = UnpinError(
            f"unpinning pool {self.name!r}: {len(failures)} chunk(s) failed to unregister "
            f"({', '.join(f'offset={f.chunk.offset} rc={f.error.code} ({f.error.reason})' for f in failures)}); "
            f"{format_bytes(sum(c.nbytes for c in leaked))} may still be pinned; the memory is kept mapped",
            failures=failures,
            leaked=leaked,
        )
        if body_error is not None:
            body_error.add_note(f"pinpool: {error}")
            return
        raise error

    def _worker_bodies(self, session: PinSession) -> list[Callable[[], None]]:
        """What each pinning thread runs: the same worker, which takes either role."""
        return [session.work] * self.threads

    def _exiting(self) -> PinSession:
        with self._exit_lock:
            if self._state != "open" or self._session is None:
                raise PoolStateError(
                    f"pool {self.name!r} is {self._state}: it can be exited once, after it was entered"
                )
            self._state = "closing"
            return self._session

    # -- async driver ---------------------------------------------------------------------------

    async def __aenter__(self) -> PinnedPool:
        session = self._open()
        try:
            await self._pin_async(session)
        except BaseException as exc:
            await self._roll_back_async(session)
            if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                raise exc.exceptions[0] from None  # users see the one error, not a task group's wrapper
            raise
        if self._state != "open":  # a chunk failed; the workers are done
            await self._roll_back_async(session)
            self._raise_pin_error(session)
        return self

    async def _roll_back_async(self, session: PinSession) -> None:
        self._note_rollback(session)
        failures = await _shielded_in_thread(session.teardown)
        self._finish_close(session, failures, None, rolled_back=True)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        session = self._exiting()
        failures = await _shielded_in_thread(session.teardown)
        self._finish_close(session, failures, exc)

    async def _pin_async(self, session: PinSession) -> None:
        bodies = self._worker_bodies(session)
        limiter = anyio.CapacityLimiter(len(bodies))
        remaining = len(bodies)
        all_done = anyio.Event()

        async def worker(body: Callable[[], None]) -> None:
            nonlocal remaining
            try:
                # abandon_on_cancel=False: the call has side effects, so wait for it.
                await anyio.to_thread.run_sync(body, limiter=limiter, abandon_on_cancel=False)
            finally:
                remaining -= 1
                if remaining == 0:
                    all_done.set()

        try:
            async with anyio.create_task_group() as tg:
                for body in bodies:
                    tg.start_soon(worker, body)
                try:
                    # The workers' waits are shielded; this one is not, so a cancellation lands
                    # here while threads run, and the workers stop after their current chunk.
                    while not all_done.is_set():
                        with anyio.move_on_after(PROGRESS_INTERVAL_SECONDS if self.on_progress else math.inf):
                            await all_done.wait()
                        if not all_done.is_set():
                            self._report_progress(session)
                except BaseException:
                    session.cancel()
                    raise
            # Quick workers must not let a pending cancellation into the body.
            await anyio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            session.cancel()
            raise
        self._after_pinning(session)

    # -- sync driver -----------------------------------------------------------------------------

    def __enter__(self) -> PinnedPool:
        session = self._open()
        workers = Threads()
        try:
            for i, body in enumerate(self._worker_bodies(session)):
                workers.start(body, name=f"pinpool-{self.name}-{i}")
            workers.wait(on_tick=lambda: self._report_progress(session) if self.on_progress else None)
            self._after_pinning(session)
        except BaseException:
            session.cancel()
            workers.wait_uninterruptibly()  # a further Ctrl-C is dropped: this one already propagates
            self._note_rollback(session)
            failures, _again = _call_uninterruptibly(session.teardown)
            self._finish_close(session, failures, None, rolled_back=True)
            raise
        if self._state != "open":
            self._note_rollback(session)
            failures, interrupt = _call_uninterruptibly(session.teardown)
            self._finish_close(session, failures, None, rolled_back=True)
            if interrupt is not None:
                raise interrupt
            self._raise_pin_error(session)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        session = self._exiting()
        failures, interrupt = _call_uninterruptibly(session.teardown)
        self._finish_close(session, failures, exc or interrupt)
        if interrupt is not None and exc is None:
            raise interrupt


async def _shielded_in_thread(fn: Callable[[], T]) -> T:
    with anyio.CancelScope(shield=True):
        result = await anyio.to_thread.run_sync(fn, abandon_on_cancel=False)
    return result


def _call_uninterruptibly(fn: Callable[[], T]) -> tuple[T, BaseException | None]:
    """Run ``fn`` on a helper thread so Ctrl-C cannot stop it half-way.

    Returns its result and the interrupt that arrived meanwhile (the caller re-raises it once
    its own bookkeeping is done).
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            error.append(exc)

    thread = Threads()
    thread.start(run, name="pinpool-teardown")
    interrupt = thread.wait_uninterruptibly()
    if error:
        raise error[0]
    return result[0], interrupt


def _release(
    session: PinSession,
    mapping: HostMapping | TensorMemory,
    *,
    nbytes: int,
    failures: tuple[ChunkFailure, ...],
    pinned: bool,
) -> tuple[Chunk, ...]:
    """After teardown: report the unpin, and let the memory go unless a chunk leaked (then it is
    kept mapped and its range stays claimed: part of it may still be pinned). Returns the leaked chunks."""
    leaked = session.ledger.leaked()
    session.observer.unpinned(
        nbytes=nbytes, seconds=session.unpin_seconds, failures=len(failures),
        leaked_bytes=sum(c.nbytes for c in leaked), pinned=pinned,
    )  # fmt: skip
    if leaked:
        mapping.keep_forever()
    else:
        PINNED_RANGES.pop(mapping.address)
    return leaked


def _finalize_unclosed(name: str, nbytes: int, session: PinSession, mapping: HostMapping | TensorMemory) -> None:
    """A pool that was never exited (garbage-collected, or alive at interpreter exit)."""
    if session.ledger.phase is Phase.CLOSED or os.getpid() != session.pid:
        return
    if session.pipeline.in_flight:
        return  # a worker is still mid-call: its driver is running and will finish or roll back
    pinned = session.ledger.registered_bytes
    session.cancel()
    failures = session.teardown()  # first: a warning turned into an error must not keep memory pinned
    _release(session, mapping, nbytes=nbytes, failures=failures, pinned=True)
    warnings.warn(
        f"PinnedPool {name!r} was never exited; unpinned its {format_bytes(pinned)} in a finalizer. "
        "Use `async with` / `with` so teardown happens where you expect it",
        UnclosedPoolWarning,
        stacklevel=2,
    )


def pin(
    tensor: torch.Tensor,
    *,
    granularity_bytes: int | None = None,
    runtime: str | Runtime = "auto",
    chunk_bytes: int | str | None = None,
    populate: bool | None = None,
    populate_workers: int | None = None,
    register_workers: int | None = None,
    unpin_workers: int | None = None,
    name: str = "tensor",
    registry: CollectorRegistry | None = REGISTRY,
    logger: Any | None = None,
    on_progress: ProgressCallback | None = None,
) -> PinnedPool:
    """Pin a contiguous CPU tensor you allocated, with PinnedPool's chunking and guarantees.

    Use it as ``with pin(t) as pinned:`` or ``async with pin(t) as pinned:``; ``pinned.tensor``
    is ``t`` (as flat bytes: ``pinned.tensors["data"]``). Chunk boundaries are multiples of
    ``granularity_bytes`` from the tensor's start. The caller's memory is never freed by
    pinpool. A tensor that overlaps memory already pinned (by pinpool, or locked by anyone
    under mlock) raises :class:`AlreadyPinnedError` on entry, with nothing changed.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"pin(tensor={type(tensor).__name__}): expected a torch.Tensor")
    if tensor.device.type != "cpu":
        raise ConfigError(f"pin(tensor on {tensor.device}): only CPU tensors live in host memory")
    if not tensor.is_contiguous():
        raise ConfigError("pin(tensor): the tensor is not contiguous; pin its storage's contiguous owner instead")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        raise ConfigError("pin(tensor): the tensor has no elements, so there is nothing to pin")
    pool = PinnedPool.__new__(PinnedPool)
    pool._configure(
        layout=_TensorLayout(tensor, granularity_bytes), size=nbytes, runtime=runtime, chunk_bytes=chunk_bytes,
        populate=populate, populate_workers=populate_workers, register_workers=register_workers,
        unpin_workers=unpin_workers, huge_pages=False, numa_node=None, name=name, source=tensor,
        registry=registry, logger=logger, on_progress=on_progress,
    )  # fmt: skip
    return pool


class _TensorLayout:
    """The layout of a caller's tensor: one buffer of exactly its bytes."""

    def __init__(self, tensor: torch.Tensor, granularity_bytes: int | None) -> None:
        self._raw = Raw(granularity_bytes=granularity_bytes)
        self._shape = tuple(tensor.shape)
        self._dtype = tensor.dtype
        self._nbytes = tensor.numel() * tensor.element_size()

    @property
    def name(self) -> str:
        return "tensor"

    @property
    def page_bytes(self) -> int:
        return self._nbytes  # the whole tensor is the only page

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        return (BufferSpec("data", self._shape, self._dtype, self._raw.granularity_bytes),)
