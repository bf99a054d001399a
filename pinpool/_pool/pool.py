"""PinnedPool: a façade whose entry and exit only run the lifecycle with a driver (nothing here decides what to pin)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType, TracebackType
from typing import TypeVar, Unpack, cast

import anyio
import torch
from prometheus_client import REGISTRY

from .. import _probe
from .._errors import ConfigError, PoolStateError
from .._node.pacing import NodeAdmission
from .._observe import Observer
from .._pin.drivers import drive_async, drive_sync, finalize_lifecycle
from .._pin.elastic import Elastic, Grown, Shrunk
from .._pin.engine import Memory, PinSession
from .._pin.lifecycle import Lifecycle
from .._pin.memory_source import PoolMemory, TensorLayout
from .._pin.outcome import PoolState, Steps, caller_outside_pinpool
from .._pin.threads import serving
from .._plan.chunks import Chunk
from .._plan.declared import keyword_signature, pool_options
from .._plan.plan import PoolPlan, plan_pool
from .._plan.preflight import place
from .._plan.reservation import pool_reservation
from .._plan.transfers import split_at_registrations
from .._units import format_bytes, parse_size
from ..layouts._spec import Layout
from ..registrars import TransferPiece, TransferRegistrar, TransferRegistration, limits_of
from ..runtimes import Runtime, capabilities_of, resolve_runtime
from ..runtimes._registry import FAILURE_REASONS
from .follow import PolicyLoop, recorded, recorded_async
from .request import PoolArguments, PoolRequest, pool_request

_WAIT_POLL_SECONDS = 0.02

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """What a pool's pinning and unpinning took, as ``pool.stats`` read it: ``pin_seconds`` (from mapping the
    memory to the last pin worker's end; 0.0 until then), ``unpin_seconds`` (teardown), ``retries`` (calls
    retried as aligned halves), ``populated_bytes`` (pre-faulted so far; under CUDA a chunk's count lands at
    its end) and ``longest_call_seconds`` (the longest runtime call so far, by op, kept after close)."""

    pin_seconds: float
    unpin_seconds: float
    retries: int
    populated_bytes: int
    longest_call_seconds: Mapping[str, float]


def _without_holes(start: int, end: int, holes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[start, end)`` less the bytes nothing registers (between a strided view's rows, outside ``ranges=``),
    as (offset, nbytes) parts."""
    parts: list[tuple[int, int]] = []
    for lo, hi in sorted(holes):
        if lo > start and start < end:
            parts.append((start, min(lo, end) - start))
        start = max(start, hi)
    if start < end:
        parts.append((start, end - start))
    return parts


def _runs_text(runs: Sequence[range]) -> str:
    return ", ".join(f"[{r.start}, {r.stop})" for r in runs) or "none"


class PinnedPool:
    """A page-locked host-memory pool, pinned in granularity-aligned chunks on worker threads.

    Use it once, as ``async with PinnedPool(...) as pool:`` or ``with PinnedPool(...) as pool:``
    (or ``pool = PinnedPool(...).open()`` ... ``pool.close()`` for an owner without a block).
    Everything is validated in the constructor (:class:`ConfigError`), before any memory is
    mapped or pinned. Inside the block ``pool.tensor`` is a zero-copy torch view of the pinned
    memory; on exit every chunk is unregistered, whatever the block did. ``pool.plan`` is what
    was decided before pinning; ``pool.registrations`` what the runtime holds right now.

    The options are declared once (``pinpool._plan.declared``): the signature and ``Options:`` follow it.
    """

    def __init__(self, **options: Unpack[PoolArguments]) -> None:
        self._build(pool_request("PinnedPool", options))

    # -- what the pool is ---------------------------------------------------------------------

    @property
    def plan(self) -> PoolPlan:
        """What was decided before pinning: sizes, chunks, order, workers (``pinpool plan --json`` shows more)."""
        return self._plan.public

    @property
    def layout(self) -> Layout:
        return self._options.layout

    @property
    def name(self) -> str:
        return self._options.name

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    @property
    def nbytes(self) -> int:
        return self._plan.nbytes

    @property
    def num_pages(self) -> int:
        return self._plan.num_pages

    def _build(self, request: PoolRequest) -> None:
        """``PinnedPool(...)`` and ``pin()``'s one path: place and check, resolve the runtime (none if doomed), plan."""
        options, memory, source = request.options, request.memory, request.source
        host = _probe.probe_host()
        if memory is not None:
            # Chunk boundaries on the file's pages (hugetlbfs: huge pages, which mlock cannot split).
            host = dataclasses.replace(host, page_size=memory.page_size)
        # An elastic pool maps and plans its whole reservation; entry pins its floor (segment 0).
        whole = options if options.reserve is None else options.reservation()
        placement = place(whole, host)
        resolved = resolve_runtime(request.runtime)
        # Own memory is page-aligned; a caller's tensor starts where it starts (at its first range with ranges).
        ranges = None if source is None else cast(TensorLayout, options.layout).ranges
        start = 0 if source is None else (source.data_ptr() + (ranges.first if ranges else 0))
        self._options, self._runtime = options, resolved
        self._caps = capabilities_of(resolved)  # declared once; the plan, the claim and the session read it
        self._registrars = tuple(request.registrars or ())
        self._plan = plan_pool(
            whole, host, self._caps, source_start=start % host.page_size, placement=placement, ranges=ranges,
            transfers=[(registrar.name, limits_of(registrar)) for registrar in self._registrars],
        )  # fmt: skip
        self._observer = Observer(
            pool=options.name, runtime=resolved.name, layout=options.layout.name, registry=request.registry,
            logger=request.logger, reasons=FAILURE_REASONS,
        )  # fmt: skip
        admission = None
        if request.pacing is not None:
            admission = NodeAdmission(request.pacing, label=options.name, on_waiting=self._observer.node_waiting)
            admission.check_request(self.nbytes)
        self._elastic: Elastic | None = None
        floor = self._plan
        if options.reserve is not None:
            reservation = pool_reservation(options, self._plan)
            self._plan = dataclasses.replace(self._plan, reservation=reservation)  # pool.plan shows it
            self._elastic = Elastic(
                self._plan, reservation, options, runtime=resolved, caps=self._caps, observer=self._observer,
                registrars=self._registrars, admission=admission,
            )  # fmt: skip
            floor = self._elastic.segment_plan(0)
        # The lifecycle holds values, never the façade, so an unexited pool is collected (its finalizer runs it).
        pool_memory = PoolMemory(
            self._plan, options, resolved, self._caps, shared=memory, tensor=source,
            pinned_first=None if self._elastic is None else floor,
        )  # fmt: skip
        self._lifecycle = Lifecycle(
            floor, options, runtime=resolved, caps=self._caps, observer=self._observer, source=pool_memory,
            admission=admission, on_progress=request.on_progress, created_at=caller_outside_pinpool(),
            registrars=self._registrars, elastic=self._elastic,
        )  # fmt: skip
        self._finalizer = weakref.finalize(self, finalize_lifecycle, self._lifecycle)
        self._loop: PolicyLoop | None = None
        if self._elastic is not None:
            self._observer.reserved = self.nbytes
        if request.elastic is not None:
            assert self._elastic is not None and request.on_give_up is not None  # the request checked them
            self._loop = PolicyLoop(
                self, request.elastic, request.on_give_up, observer=self._observer, page_bytes=self._plan.page_bytes,
                floor_pages=self._elastic.reservation.floor_pages, source=request.pressure,
            )  # fmt: skip
            self._lifecycle.policy_loop = self._loop

    def __repr__(self) -> str:
        plan = self._plan
        return (
            f"<PinnedPool {self.name!r} {self._lifecycle.state.value} {format_bytes(self.nbytes)} "
            f"layout={self.layout.name} runtime={self.runtime.name} "
            f"chunks={len(plan.chunks)}x<={format_bytes(plan.chunk_bytes)} order={plan.order.value} "
            f"workers=populate:{plan.populate_workers},register:{plan.register_workers}>"
        )

    # -- state and readiness -------------------------------------------------------------------

    def _require_open(self, what: str) -> Mapping[str, torch.Tensor]:
        tensors = self._lifecycle.tensors
        if tensors is None:
            hint = (
                "enter it first (async with / with)"
                if self._lifecycle.state in (PoolState.NEW, PoolState.PINNING)
                else "it was exited and unpinned; create a new pool"
            )
            raise PoolStateError(f"pool {self.name!r}.{what} is only available while the pool is open: {hint}")
        return tensors

    def _memory(self, what: str) -> Memory:
        """The pool's memory, or PoolStateError: closed before, or meanwhile by another thread or a signal handler."""
        self._require_open(what)
        memory = self._lifecycle.memory
        if memory is None:
            raise PoolStateError(f"pool {self.name!r}.{what}: the pool was closed meanwhile (close() ran during it)")
        return memory

    @property
    def state(self) -> PoolState:
        """Where the pool is: new, pinning, ready, failed (background pinning), closing, closed."""
        return self._lifecycle.state

    @property
    def error(self) -> BaseException | None:
        """Why background pinning failed (state ``failed``), else None. A read changes nothing (a
        debugger's included): exit raises it unless a waiter raised it first."""
        return self._lifecycle.error

    @property
    def pinned_pages(self) -> int:
        """Layout pages ``[0, k)`` pinned now in every buffer: what a background pool's body may use."""
        return self._lifecycle.pinned_pages

    def _pages_for(self, min_bytes: int | str | None, fraction: float | None) -> int | None:
        """The page count a wait needs: None for the whole pool (ready)."""
        if min_bytes is not None and fraction is not None:
            raise ConfigError(
                "wait_ready(min_bytes=..., fraction=...): give one of them, or neither for the whole pool"
            )
        num_pages, page_bytes = self.num_pages, self._plan.page_bytes
        if min_bytes is not None:
            nbytes = parse_size(min_bytes, what="min_bytes")
            if nbytes > self.nbytes:
                raise ConfigError(
                    f"wait_ready(min_bytes={min_bytes!r}): the pool holds {format_bytes(self.nbytes)}; "
                    "ask for at most that (or nothing, for the whole pool)"
                )
            return min(num_pages, -(-nbytes // page_bytes))
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
                raise ConfigError(f"wait_ready(fraction={fraction!r}) must be a number in (0, 1]")
            return max(1, math.ceil(fraction * num_pages))
        return None

    async def wait_ready(self, *, min_bytes: int | str | None = None, fraction: float | None = None) -> int:
        """Wait until the pool, or its first ``min_bytes`` or ``fraction``, is pinned; returns ``pinned_pages``.
        Cancellable; raises a background :class:`PinError` (every waiter), :class:`PoolStateError` if not open."""
        pages = self._pages_for(min_bytes, fraction)
        delay = 0.001
        while not self._lifecycle.reached(pages):
            await anyio.sleep(delay)
            delay = min(delay * 2, _WAIT_POLL_SECONDS)
        return self.pinned_pages

    def wait_ready_sync(
        self, *, min_bytes: int | str | None = None, fraction: float | None = None, timeout: float | None = None
    ) -> int:
        """:meth:`wait_ready` for synchronous code; raises ``TimeoutError`` after ``timeout`` seconds."""
        pages = self._pages_for(min_bytes, fraction)
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or math.isnan(timeout) or timeout < 0
        ):
            raise ConfigError(
                f"wait_ready_sync(timeout={timeout!r}) must be a number of seconds >= 0 (math.inf or None: no timeout)"
            )
        deadline = None if timeout is None or math.isinf(timeout) else time.monotonic() + timeout
        delay = 0.001
        while not self._lifecycle.reached(pages):
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"pool {self.name!r} not ready after {timeout} s: {format_bytes(self.pinned_bytes)} of "
                    f"{format_bytes(self.nbytes)} pinned, pages [0, {self.pinned_pages}) usable"
                )
            time.sleep(delay)
            delay = min(delay * 2, _WAIT_POLL_SECONDS)
        return self.pinned_pages

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Buffer name → zero-copy tensor over the pinned memory, shaped by the layout."""
        return self._require_open("tensors")

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
        return self._memory("data_ptr").address

    @property
    def pinned_bytes(self) -> int:
        """Bytes pinned right now (moving within a chunk under lock-on-fault); 0 before entry and
        after exit; after a background failure, what stays pinned until exit (docs/serving.md)."""
        return sum(session.ledger.pinned_bytes for session in self._sessions())

    def _sessions(self) -> list[PinSession]:
        """Every live session: the floor's (the whole pool's when fixed), then each segment's."""
        session = self._lifecycle.session
        floor = [] if session is None else [session]
        return floor + ([] if self._elastic is None else [s for _i, s in self._elastic.live_sessions()])

    @property
    def registrations(self) -> tuple[Chunk, ...]:
        """What the runtime holds now, one :class:`pinpool.Chunk` per live registration call (offsets from
        ``pool.data_ptr``, sorted), from any thread (docs/concepts.md, "Chunks and registrations")."""
        return tuple(sorted((c for s in self._sessions() for c in s.registrations()), key=lambda c: c.offset))

    @property
    def stats(self) -> PoolStats:
        """What pinning and unpinning took so far, read now (all zero before entry)."""
        session = self._lifecycle.session
        longest = MappingProxyType(dict(self._observer.longest))
        if session is None:
            return PoolStats(0.0, 0.0, 0, 0, longest)
        return PoolStats(session.pin_seconds, session.unpin_seconds, session.retries, session.pipeline.populated_bytes,
                         longest)  # fmt: skip

    # -- transfer registrars ----------------------------------------------------------------------

    @property
    def registrars(self) -> tuple[TransferRegistrar, ...]:
        """The transfer registrars the pool registers with (``registrars=``), in order."""
        return self._registrars

    def _registrar_index(self, registrar: TransferRegistrar | str) -> int:
        for index, known in enumerate(self._registrars):
            if known is registrar or known.name == registrar:
                return index
        names = [known.name for known in self._registrars]
        raise ConfigError(
            f"registrar {getattr(registrar, 'name', registrar)!r} is not one of pool {self.name!r}'s registrars "
            f"{names}: pass one of them (or its name), as given to registrars="
        )

    def transfer_registrations(self, registrar: TransferRegistrar | str) -> tuple[TransferRegistration, ...]:
        """What ``registrar`` (the object or its name) holds of the pool now, sorted; empty when not open."""
        index = self._registrar_index(registrar)
        session, memory = self._lifecycle.session, self._lifecycle.memory
        if session is None or session.transfers is None or memory is None:
            return ()
        name = self._registrars[index].name
        held = [
            TransferRegistration(name, run.offset, run.nbytes, memory.address + run.offset, handle)
            for run, handle in session.transfers.live(index)
        ]
        if self._elastic is not None:
            held += self._elastic.transfer_registrations(index, name, memory.address)
        return tuple(sorted(held, key=lambda r: r.offset))

    def transfer_pieces(
        self, registrar: TransferRegistrar | str, *, pages: range | None = None, offset: int | None = None,
        nbytes: int | None = None,
    ) -> tuple[TransferPiece, ...]:  # fmt: skip
        """The ranges a transfer through ``registrar`` may address, each inside one of its registrations: layout
        pages ``pages`` (their bytes in every buffer, in buffer order) or bytes ``[offset, offset + nbytes)``.
        :class:`PoolStateError` for bytes it does not hold yet (a background pool: wait for them first)."""
        index = self._registrar_index(registrar)
        spans = self._transfer_spans(pages, offset, nbytes)
        memory, session = self._memory("transfer_pieces"), self._lifecycle.session
        if session is None or session.transfers is None:
            raise PoolStateError(f"pool {self.name!r}.transfer_pieces: the pool was closed meanwhile")
        if self._elastic is not None:
            what = f"pool {self.state.value}, pages {_runs_text(self.pinned_runs)} usable"
            name = self._registrars[index].name
            return self._elastic.transfer_pieces(index, name, spans, session, memory.address, what)
        plan, name = self._plan.transfers[index], self._registrars[index].name
        cut = [piece for start, length in spans for piece in split_at_registrations(plan, start, length)]
        held = session.transfers.held(index, {r for _offset, _nbytes, r in cut})
        pieces: list[TransferPiece] = []
        for piece_offset, piece_bytes, r in cut:
            run = plan.registrations[r]
            if r not in held:
                raise PoolStateError(
                    f"pool {self.name!r}: bytes [{run.offset}, {run.end}) are not registered with {name!r} now "
                    f"(pool {self.state.value}, pages [0, {self.pinned_pages}) usable): wait_ready() for the pages "
                    "first, and address a pool only while it is open"
                )
            registration = TransferRegistration(name, run.offset, run.nbytes, memory.address + run.offset, held[r])
            pieces.append(TransferPiece(piece_offset, piece_bytes, memory.address + piece_offset, registration))
        return tuple(pieces)

    def _transfer_spans(self, pages: range | None, offset: int | None, nbytes: int | None) -> list[tuple[int, int]]:
        if (pages is None) == (offset is None and nbytes is None):
            raise ConfigError("transfer_pieces(): give pages=range(first, stop), or offset= and nbytes=")
        if pages is None:
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, nbytes)):
                raise ConfigError(f"transfer_pieces(offset={offset!r}, nbytes={nbytes!r}): both are int byte counts")
            assert offset is not None and nbytes is not None
            if offset < 0 or nbytes <= 0 or offset + nbytes > self._plan.mapping_bytes:
                raise ConfigError(
                    f"transfer_pieces(offset={offset}, nbytes={nbytes}) is outside pool {self.name!r} "
                    f"(bytes [0, {self._plan.mapping_bytes})): address bytes of the pool, nbytes > 0"
                )
            return [(offset, nbytes)]
        if not isinstance(pages, range) or pages.step != 1 or not 0 <= pages.start < pages.stop <= self.num_pages:
            raise ConfigError(
                f"transfer_pieces(pages={pages!r}) must be range(first, stop) with 0 <= first < stop <= "
                f"{self.num_pages} (the pool's pages), step 1"
            )
        spans = []
        for run in self._plan.page_runs:
            if run.page_bytes is None:
                raise ConfigError(
                    f"pool {self.name!r}: layout {self.layout.name!r} does not keep its pages in page order in bytes "
                    f"[{run.start}, {run.end}); address bytes instead (offset=, nbytes=)"
                )
            start = run.start + pages.start * run.page_bytes
            spans.extend(_without_holes(start, start + len(pages) * run.page_bytes, run.holes))
        return spans

    # -- an elastic pool (reserve=): grow and shrink -------------------------------------------

    @property
    def reserved_pages(self) -> int:
        """The pages the pool may hold pinned at most: the reservation (``num_pages``; a fixed pool: all)."""
        return self.num_pages

    @property
    def pinned_runs(self) -> tuple[range, ...]:
        """The page ranges usable now, sorted and merged: a fixed pool's ``[0, pinned_pages)``; an elastic
        pool's floor (as far as it is pinned) and every segment grown and not given up."""
        floor = self._lifecycle.pinned_pages if self._elastic is None else self._floor_usable()
        if self._elastic is None:
            return (range(0, floor),) if floor else ()
        return self._elastic.usable_runs(floor)

    def _floor_usable(self) -> int:
        return self._lifecycle._floor_pages()

    def _resizing(self, what: str) -> tuple[Elastic, Memory]:
        elastic, lifecycle = self._elastic, self._lifecycle
        if elastic is None:
            raise ConfigError(
                f"pool {self.name!r}.{what}: a fixed pool (reserve=None) neither grows nor shrinks; create it with "
                "reserve= (the most it may grow to) and size= (what it pins at entry)"
            )
        memory = lifecycle.memory
        if lifecycle.state not in (PoolState.READY, PoolState.PINNING) or memory is None:
            raise PoolStateError(
                f"pool {self.name!r}.{what}: the pool is {lifecycle.state.value}; a pool grows and shrinks only "
                "while it is open (inside async with / with, after open())"
            )
        return elastic, memory

    def _grow_pages(self, pages: int | None, nbytes: int | str | None) -> int:
        if (pages is None) == (nbytes is None):
            raise ConfigError("grow(): give pages=N (layout pages) or nbytes= (a size), one of them")
        if nbytes is None:
            return cast(int, pages)
        size = parse_size(nbytes, what="nbytes")
        return max(1, -(-size // self._plan.page_bytes))

    async def grow(self, *, pages: int | None = None, nbytes: int | str | None = None) -> Grown:
        """Pin at least ``pages`` more pages (or ``nbytes``): the lowest free segments, whole, each usable (in
        ``pinned_runs``) once pinned. Cancellable; a failure or cancellation undoes the segment in flight and
        raises (segments pinned before stay). :class:`PoolStateError` beyond the reservation or while a grow runs."""
        elastic, memory = self._resizing("grow()")
        count = self._grow_pages(pages, nbytes)
        grown: Grown = await recorded_async(
            self._observer,
            "grow",
            self._usable_bytes,
            self._plan.page_bytes,
            self._drive_async(elastic.grow(memory, count)),
        )
        return grown

    def grow_sync(self, *, pages: int | None = None, nbytes: int | str | None = None) -> Grown:
        """:meth:`grow` for synchronous code (Ctrl-C undoes the segment in flight)."""
        elastic, memory = self._resizing("grow_sync()")
        steps = elastic.grow(memory, self._grow_pages(pages, nbytes))
        grown: Grown = recorded(self._observer, "grow", self._usable_bytes, self._plan.page_bytes,
                                functools.partial(self._drive, steps))  # fmt: skip
        return grown

    async def shrink(self, *, pages: Sequence[range] | None = None, to_pages: int | None = None) -> Shrunk:
        """Give up pages the caller no longer uses: ``to_pages=k`` (every page from ``k`` on) or ``pages=``
        (ranges its allocator freed). Segments named whole are unpinned and their pages given back to the host
        (they read zero after); the other named pages stay usable (``kept``). Anything not usable now (the floor,
        a growing segment, pages never grown) is refused with a typed error, and nothing changes."""
        elastic, memory = self._resizing("shrink()")
        steps = elastic.shrink(memory, pages=pages, to_pages=to_pages)
        shrunk: Shrunk = await recorded_async(
            self._observer, "shrink", self._usable_bytes, self._plan.page_bytes, self._drive_async(steps)
        )
        return shrunk

    def shrink_sync(self, *, pages: Sequence[range] | None = None, to_pages: int | None = None) -> Shrunk:
        """:meth:`shrink` for synchronous code."""
        return self._shrink_sync(pages=pages, to_pages=to_pages)

    def _shrink_sync(
        self, *, pages: Sequence[range] | None = None, to_pages: int | None = None, decided_at: float | None = None
    ) -> Shrunk:
        """:meth:`shrink_sync`, timed from ``decided_at`` (the policy loop's decision, monotonic) if given."""
        elastic, memory = self._resizing("shrink_sync()")
        steps = elastic.shrink(memory, pages=pages, to_pages=to_pages)
        shrunk: Shrunk = recorded(self._observer, "shrink", self._usable_bytes, self._plan.page_bytes,
                                  functools.partial(self._drive, steps), started=decided_at)  # fmt: skip
        return shrunk

    def _growing(self) -> bool:
        return self._elastic is not None and self._elastic.book.grow is not None

    def _usable_bytes(self) -> int:
        return sum(len(r) for r in self.pinned_runs) * self._plan.page_bytes

    def want(self, *, pages: int | None = None, nbytes: int | str | None = None) -> None:
        """Tell the policy loop (``elastic=``) the server needs ``pages`` (or ``nbytes``) more than it has now:
        it grows by whole segments when memory allows (pressure wins; a later call replaces the ask; 0 withdraws
        it). Returns at once: watch ``pinned_runs``, or ``await pool.grow()`` to wait for pages yourself."""
        if self._loop is None:
            raise ConfigError(
                f"pool {self.name!r}.want(): the pool has no policy loop; create it with elastic=ElasticPolicy(...) "
                "(and on_give_up=), or grow it yourself with grow()/grow_sync()"
            )
        self._resizing("want()")
        if pages is not None and (type(pages) is not int or pages < 0):
            raise ConfigError(f"want(pages={pages!r}): use a whole number of layout pages, 0 or more (0: no ask)")
        if pages == 0 and nbytes is None:
            self._loop.ask(0)
            return
        self._loop.ask(self._grow_pages(pages, nbytes) * self._plan.page_bytes)

    # -- the drivers: each only runs the lifecycle ----------------------------------------------

    async def __aenter__(self) -> PinnedPool:
        await self._drive_async(self._lifecycle.enter(), undo=functools.partial(self._lifecycle.exit, None))
        self._start_loop()
        return self

    def _start_loop(self) -> None:
        """The policy loop follows the host from entry on (a background floor may still be pinning)."""
        if self._loop is not None:
            self._loop.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, GeneratorExit):  # the coroutine is being closed and cannot await: leave synchronously
            self._drive(self._lifecycle.exit(exc))
            return
        await self._drive_async(self._lifecycle.exit(exc))

    def __enter__(self) -> PinnedPool:
        self._drive(self._lifecycle.enter(), undo=functools.partial(self._lifecycle.exit, None))
        self._start_loop()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._drive(self._lifecycle.exit(exc))

    def open(self) -> PinnedPool:
        """``__enter__`` for owners that hold a pool from a constructor to a destructor; pair it with
        :meth:`close`. A :meth:`close` meanwhile rolls it back and it raises :class:`PoolStateError`."""
        return self.__enter__()

    def close(self, *, raise_errors: bool = True) -> BaseException | None:
        """Stop background pinning, unpin every chunk, let go of the memory: from any thread (a signal handler:
        docs/serving.md), more than once, never :class:`PoolStateError`. Raises :class:`UnpinError` or an unseen
        :class:`PinError` (``raise_errors=False`` returns it); interruptions are re-raised after the teardown.
        Inside a runtime, registrar or ``on_progress`` call on pinpool's own thread it starts the close on a thread
        of its own and returns None at once (the pool's driver waits for the thread it was called on)."""
        if id(self._lifecycle) in serving():  # in a runtime's, registrar's or on_progress's call: its driver waits
            # Its errors are logged (pool.unpin.failed, pool.failed); no thread (exit): the driver ends the pool.
            self._lifecycle.gate.close_requested = True
            close = functools.partial(self.close, raise_errors=False)
            with contextlib.suppress(RuntimeError):
                threading.Thread(target=close, name=f"pinpool-{self.name}-close", daemon=True).start()
            return None
        return self._drive(self._lifecycle.exit(None, closing=True, raise_errors=raise_errors))

    def _drive(self, steps: Steps[_T], undo: Callable[[], Steps[object]] | None = None) -> _T:
        """Run the pool's steps here; its workers know whose driver waits for them (close() in their calls)."""
        return drive_sync(steps, undo, owner=self._lifecycle)

    def _drive_async(self, steps: Steps[_T], undo: Callable[[], Steps[object]] | None = None) -> Awaitable[_T]:
        return drive_async(steps, undo, owner=self._lifecycle)


# For help() and inspect: every keyword with its default; the docstring's Options: their help.
PinnedPool.__init__.__signature__ = keyword_signature(["self"], pool_options(), "None", registry=REGISTRY)  # type: ignore[attr-defined]
PinnedPool.__doc__ = (
    (PinnedPool.__doc__ or "") + "\n    Options:\n" + "".join(f"      {o.name}: {o.help}.\n" for o in pool_options())
)
