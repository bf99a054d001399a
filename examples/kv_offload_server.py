"""A KV-cache offload server that serves while its host pool pins in the background.

    python examples/kv_offload_server.py --size 2GiB --runtime mlock      # http://127.0.0.1:8080
    python examples/kv_offload_server.py --size 2GiB --trio               # hypercorn's trio worker
    python examples/kv_offload_server.py --size 1GiB --elastic 8GiB       # grows and shrinks with the host

The pool is entered in a Starlette lifespan with ``background=True``: ``async with`` returns as
soon as pinning has started, so the server answers requests at once while the pool pins, lowest
pages first, on pinpool's threads. Endpoints (JSON bodies unless said otherwise):

* ``GET /healthz``: 200 at once, whatever the pool is doing (a liveness probe must not fail
  because a large pool is still pinning).
* ``GET /readyz``: 503 while pinning (state, pinned_bytes, pinned_pages, num_pages), 200 when
  the whole pool is pinned, 500 with the error text if pinning failed. pinpool keeps the pages
  already pinned (pages ``[0, pinned_pages)``) until the pool is exited: the server stops taking
  new data, still serves reads of those pages (draining), and an orchestrator restarts it.
* ``GET /metrics``: the pool's Prometheus registry (text format).
* ``PUT /pages/{i}`` (body: exactly one KV page, ``page_bytes`` bytes) and ``GET /pages/{i}``
  (answers those bytes): copy page ``i`` between a device tensor (CUDA when torch sees one, else
  CPU) and the pool. 404 out of range, 409 while page ``i`` is not pinned yet (the body says
  ``pinned_pages``), 400 for a body of the wrong size, 503 once the pool has failed or closed.
  An upload that has not arrived whole when the server begins to shut down is answered 503 at
  once (a stalled client does not hold up the shutdown), and one that takes longer than
  ``BODY_SECONDS`` is answered 408; both close the connection.

* ``GET /transfer?first=A&count=N`` (with ``--transfer-engine mooncake|nixl``): what a peer needs to read
  or write pages ``[A, A+N)`` with its own engine: this server's engine (Mooncake's segment name, or the
  NIXL agent's name and metadata), where each page's slices lie, and the pieces to address, each inside one
  registration with the engine (examples/kv_transfer.py). 409 while a page is not usable yet, 404 out of
  range (or without an engine), 400 for bad numbers, 503 once the pool has failed or closed.

A page's bytes are the page's slice of every buffer, in the layout's buffer order, and within a
buffer in run order: for the default ``MHA page_first`` layout (one ``kv`` buffer shaped
``(2, pages * page_size, layers, heads, head_dim)``) that is K's ``page_size`` tokens of every
layer, then V's.

Pages become usable as the pool pins: ``/readyz`` says ``pinned_pages``. With a combined K/V
buffer (every MHA layout here) page ``i`` needs its K slice and its V slice: pinpool interleaves
K's and V's chunks, so page 0 is usable once the first chunk of each half is pinned. How many
chunks the 2 GiB default has depends on the host (``pinpool plan --size 2GiB`` prints them: one
2 GiB chunk on a 2-CPU host, so its pages appear only at the end of the pin); larger pools have
more chunks per half and start sooner.

The stall budget (``--max-call-seconds``, 50 ms by default) matters as much as
``background=True``: a pinning call holds the process's ``mmap_lock`` (and, under CUDA,
registration holds the driver lock), and every ``mmap`` the serving thread makes (a Python
arena, a large allocation, an import) waits for it. Without a budget, one call faults up to
512 MiB, and on a busy host this server's event loop could not even finish starting until a
2 GiB pool was fully pinned; with it, the port opens ~0.1 s into pinning.

SIGTERM or SIGINT at any moment (while pinning too, or with a client stalled in the middle of an
upload) shuts down gracefully: uploads still coming in are answered 503, the lifespan leaves the
pool, which stops pinning and unpins everything, then the process logs
``kv_offload_server: shutdown VmLck=<bytes>`` on stderr and exits 0. A bad option (``--port
99999``) is one line and exit 2, as argparse does; a pool the host cannot hold, which pinpool's
pre-flight refuses when the lifespan enters it, is one line naming the value and the fix
(``kv_offload_server: cannot start: ...``) and exit 3, a failed start-up as uvicorn reports it.

It listens on port 8080 by default (``--port``): 8000 is ``mkdocs serve``'s, which a checkout
may be running. It uses pinpool's public API and the standard library besides its server
packages: ``pip install starlette uvicorn`` (``hypercorn[trio]`` for ``--trio``), all in
pinpool's ``test`` extra. Under mlock the pool is charged to RLIMIT_MEMLOCK: run as root, or
raise ``ulimit -l``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import anyio
import torch
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import pinpool
from pinpool import PoolState, layouts

if TYPE_CHECKING:
    from kv_transfer import TransferEngine  # beside this file; loaded only for --transfer-engine

DEFAULT_PORT = 8080  # not 8000: that is mkdocs serve's, which a checkout may be running


def log(message: str) -> None:
    print(f"kv_offload_server: {message}", file=sys.stderr, flush=True)


def vm_locked_bytes() -> int:
    """What the kernel counts as locked in this process (VmLck in /proc/self/status), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    return 0


# A page's body must arrive whole within this; a client that stalls gets 408 instead of holding a
# request (and, at shutdown, the server's graceful exit) for ever.
BODY_SECONDS = 10.0
# How often a request waiting for its body looks whether the server is shutting down.
SHUTDOWN_POLL_SECONDS = 0.1


class Stopping:
    """Set when the server begins its graceful shutdown (SIGTERM or SIGINT arrived).

    Both servers wait (up to their graceful timeout) for requests in progress before the
    lifespan exits; an upload from a stalled client would wait for its body until then and be
    cancelled, and uvicorn prints that cancellation as "Exception in ASGI application" with a
    traceback. A request waiting for its body ends with 503 as soon as this is set instead.
    """

    def __init__(self) -> None:
        self.requested = False
        # The pool refused to start (a pre-flight ConfigError: the host cannot hold it), already
        # said in one line: the server exits 3 without printing it again as a traceback.
        self.refused: pinpool.ConfigError | None = None
        self.on_stop: list[Any] = []  # called when the shutdown begins (a held registration is let go)

    def stop(self) -> None:
        self.requested = True
        for hook in self.on_stop:
            hook()


@dataclass(frozen=True)
class PageSlice:
    """Where page ``i`` lives in one buffer: the buffer as ``(runs, num_pages, slice_bytes)`` bytes."""

    name: str
    runs: int
    slice_bytes: int

    @property
    def nbytes(self) -> int:
        return self.runs * self.slice_bytes


def page_slices(layout: pinpool.layouts.Layout, num_pages: int) -> tuple[PageSlice, ...]:
    """Each buffer's share of one page, from the layout's BufferSpecs: a buffer is ``page_runs``
    equal runs back to back, and page ``i`` is the ``i``-th equal slice of each run."""
    slices = []
    for spec in layout.buffers(num_pages):
        if spec.nbytes == 0:
            continue
        if spec.page_runs is None:
            raise SystemExit(f"layout {layout.name}: buffer {spec.name!r} does not say where its pages are")
        slices.append(PageSlice(spec.name, spec.page_runs, spec.nbytes // (spec.page_runs * num_pages)))
    total = sum(s.nbytes for s in slices)
    assert total == layout.page_bytes, (total, layout.page_bytes)
    return tuple(slices)


class KVOffload:
    """The pool, the device-side staging page, and the page copies between them."""

    def __init__(self, pool: pinpool.PinnedPool, device: torch.device) -> None:
        self.pool = pool
        self.device = device
        self.slices = page_slices(pool.layout, pool.num_pages)
        # One page on the device: a request's bytes land here before they go to the pool, and a
        # page read from the pool passes through here (as a GPU KV cache page would).
        self.staging = torch.empty(pool.plan.page_bytes, dtype=torch.uint8, device=device)

    def _host_page(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(pool slice, staging slice) pairs of page ``i`` as contiguous bytes, one per run of
        each buffer (copies from and to contiguous pinned memory take the fast DMA path)."""
        pairs = []
        offset = 0
        tensors = self.pool.tensors  # raises once the pool is closed; callers check first
        for s in self.slices:
            runs = tensors[s.name].view(-1).view(torch.uint8).view(s.runs, self.pool.num_pages, s.slice_bytes)
            for run in range(s.runs):
                pairs.append((runs[run, i], self.staging[offset : offset + s.slice_bytes]))
                offset += s.slice_bytes
        return pairs

    # The copies are synchronous and run on the event loop with no await between the
    # pinned-pages check and the copy, so the lifespan cannot leave the pool in the middle of
    # one, and two requests never share the staging page at once.
    def put(self, i: int, body: bytearray) -> None:
        self.staging.copy_(torch.frombuffer(body, dtype=torch.uint8))  # host -> device
        for host, device in self._host_page(i):
            host.copy_(device)  # device -> pinned host page

    def get(self, i: int) -> bytes:
        for host, device in self._host_page(i):
            device.copy_(host)  # pinned host page -> device
        body = bytearray(self.staging.numel())
        torch.frombuffer(body, dtype=torch.uint8).copy_(self.staging)  # device -> the response's bytes
        return bytes(body)

    def runs(self, first: int) -> list[dict[str, Any]]:
        """Where page ``first``'s slices lie in the pool, in ``GET /pages`` order: page ``first + k``'s
        slice of each run is ``page_bytes`` bytes at ``offset + k * page_bytes``."""
        base, tensors = self.pool.data_ptr, self.pool.tensors
        return [
            {"buffer": s.name, "page_bytes": s.slice_bytes,
             "offset": tensors[s.name].data_ptr() - base + (run * self.pool.num_pages + first) * s.slice_bytes}
            for s in self.slices for run in range(s.runs)
        ]  # fmt: skip


class Tail:
    """With --elastic, this server's allocator: pages are used from 0 up, so every usable page above the
    highest one written is free; under memory pressure the pool's policy takes (some of) those."""

    def __init__(self) -> None:
        self.top = -1
        self.pool: Callable[[], pinpool.PinnedPool | None] = lambda: None

    def give_up(self, nbytes: int) -> list[range]:
        pool = self.pool()
        return [] if pool is None else [range(max(r.start, self.top + 1), r.stop) for r in pool.pinned_runs
                                        if r.stop > self.top + 1]  # fmt: skip


def pool_status(pool: pinpool.PinnedPool) -> dict[str, Any]:
    return {
        "state": pool.state.value,
        "pinned_bytes": pool.pinned_bytes,
        "pinned_pages": pool.pinned_pages,
        "num_pages": pool.num_pages,
        "nbytes": pool.nbytes,
        "page_bytes": pool.plan.page_bytes,
    }


async def report_readiness(pool: pinpool.PinnedPool, started: float) -> None:
    """Log when the pool is ready, or why its pinning failed (taking the error as seen)."""
    try:
        await pool.wait_ready()
    except pinpool.PinError as error:
        log(
            f"pinning failed after {time.monotonic() - started:.3f} s; pages [0, {pool.pinned_pages}) stay "
            f"pinned for reads until shutdown, no new data is taken: {error}"
        )
        return
    log(f"pool ready: {pool.nbytes} bytes, {pool.num_pages} pages in {time.monotonic() - started:.3f} s")


async def read_body(request: Request, limit: int, stopping: Stopping) -> bytearray | Response:
    """The request's body (reading stops past ``limit`` bytes), or the answer to give instead:
    503 when the server began to shut down first, 408 when it took longer than BODY_SECONDS, and
    no answer at all (the client is gone) when the client disconnected. The raw ASGI ``receive``
    is awaited under a timeout, which loses nothing (Starlette's ``request.stream()`` would end
    for good on the first one)."""
    body = bytearray()
    deadline = time.monotonic() + BODY_SECONDS
    while True:
        if stopping.requested:
            return JSONResponse({"error": "the server is shutting down", "got": len(body)}, status_code=503,
                                headers={"Connection": "close"})  # fmt: skip
        if time.monotonic() >= deadline:
            return JSONResponse({"error": f"the body did not arrive within {BODY_SECONDS:g} s", "got": len(body)},
                                status_code=408, headers={"Connection": "close"})  # fmt: skip
        with anyio.move_on_after(SHUTDOWN_POLL_SECONDS):
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return Response(status_code=499)  # nginx's "client closed request": it is never sent
            body += message.get("body", b"")
            if not message.get("more_body", False) or len(body) > limit:
                return body


def create_app(
    pool: pinpool.PinnedPool, registry: CollectorRegistry, device: torch.device, stopping: Stopping | None = None,
    transfer: TransferEngine | None = None, tail: Tail | None = None,
) -> QuietRefusal:  # fmt: skip
    kv = KVOffload(pool, device)
    stopping = Stopping() if stopping is None else stopping
    held = None if transfer is None else transfer.held

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        started = time.monotonic()
        async with contextlib.AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(pool)  # returns at once: background=True
            except BaseException as error:
                if held is not None:
                    held.opened(None)  # registrations do not wait for a pool that never opened
                if isinstance(error, pinpool.ConfigError):  # the pre-flight refused: it names the value and the fix
                    log(f"cannot start: {error}")
                    stopping.refused = error
                raise
            if held is not None:
                held.opened(pool)  # the held registration is found by its address
            log(
                f"pinning {pool.nbytes} bytes ({pool.num_pages} pages of {pool.plan.page_bytes} bytes, "
                f"layout {pool.layout.name}, runtime {pool.runtime.name}, device {device}) in the background"
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(report_readiness, pool, started)
                yield  # serving
                # A failure is waited for, so it is said (and seen: exit then does not raise it), never cancelled
                # unsaid; reading pool.error in /readyz does not mark it seen.
                if pool.state is not PoolState.FAILED:
                    tg.cancel_scope.cancel()
            log(f"shutting down: leaving the pool in state {pool.state.value} ({pool.pinned_bytes} bytes pinned)")
        log(f"pool {pool.state.value}; unpinned in {pool.stats.unpin_seconds:.3f} s")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok", "state": pool.state.value})

    async def readyz(request: Request) -> Response:
        body = pool_status(pool)
        if pool.state is PoolState.READY:
            return JSONResponse(body, status_code=200)
        if pool.state is PoolState.FAILED:
            body["error"] = str(pool.error)
            return JSONResponse(body, status_code=500)
        return JSONResponse(body, status_code=503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def refuse(i: int, *, writing: bool) -> Response | None:
        """Why page ``i`` cannot be copied now, or None. Once pinning failed the server drains:
        pages already pinned can still be read (pinpool keeps them pinned until exit), nothing new
        is written."""
        if i >= pool.num_pages:
            return JSONResponse({"error": f"page {i} out of range", "num_pages": pool.num_pages}, status_code=404)
        state = pool.state
        draining = state is PoolState.FAILED and not writing and i < pool.pinned_pages
        if state not in (PoolState.PINNING, PoolState.READY) and not draining:
            body = pool_status(pool)
            body["error"] = (
                f"pinning failed: {pool.error}" if state is PoolState.FAILED else f"the pool is {state.value}"
            )
            return JSONResponse(body, status_code=503)
        pinned = pool.pinned_pages
        if i >= pinned:
            if tail is not None and writing:
                pool.want(pages=i + 1 - pinned)  # the policy grows by whole segments once the host is calm
            body = pool_status(pool) | {"pinned_pages": pinned, "error": f"page {i} is not pinned yet"}
            return JSONResponse(body, status_code=409)
        return None

    async def put_page(request: Request) -> Response:
        i = request.path_params["i"]
        if (refusal := refuse(i, writing=True)) is not None:
            return refusal
        body = await read_body(request, pool.plan.page_bytes, stopping)
        if isinstance(body, Response):
            return body
        if len(body) != pool.plan.page_bytes:
            return JSONResponse(
                {"error": f"the body must be exactly one page: {pool.plan.page_bytes} bytes", "got": len(body)},
                status_code=400,
            )
        if (refusal := refuse(i, writing=True)) is not None:  # the pool may have failed or closed meanwhile
            return refusal
        kv.put(i, body)
        if tail is not None:
            tail.top = max(tail.top, i)
        return JSONResponse({"page": i, "bytes": len(body)})

    async def get_page(request: Request) -> Response:
        i = request.path_params["i"]
        if (refusal := refuse(i, writing=False)) is not None:
            return refusal
        return Response(kv.get(i), media_type="application/octet-stream")

    def bad(error: str) -> Response:
        return JSONResponse({"error": error}, status_code=400)

    async def transfer_pages(request: Request) -> Response:
        """What a peer needs to move pages ``[first, first + count)`` with its own engine: this server's
        engine (``peer()``), where each page's slices lie (``runs``) and the pieces to address, each inside
        one registration with the engine (a descriptor built from them never straddles two)."""
        if transfer is None:
            return JSONResponse({"error": "this server serves no transfer engine: start it with "
                                 "--transfer-engine mooncake or --transfer-engine nixl"}, status_code=404)  # fmt: skip
        query = request.query_params
        try:
            first, count = int(query.get("first", "")), int(query.get("count", "1"))
        except ValueError:
            return bad(f"give first=PAGE and count=PAGES as integers (got first={query.get('first')!r}, "
                       f"count={query.get('count')!r})")  # fmt: skip
        if first < 0 or count < 1:
            return bad(f"first={first} must be >= 0 and count={count} >= 1")
        # The last page decides: pages [0, pinned_pages) are pinned and registered with every engine.
        if (refusal := refuse(first + count - 1, writing=False)) is not None:
            return refusal
        try:
            pieces = pool.transfer_pieces(transfer.registrar.name, pages=range(first, first + count))
        except pinpool.PoolStateError as error:  # not registered (or no longer): the pool is failing or closing
            body = pool_status(pool) | {"error": str(error)}
            return JSONResponse(body, status_code=409 if pool.state is PoolState.PINNING else 503)
        return JSONResponse(transfer.answer(first, count, kv.runs(first), pieces))

    routes = [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
        Route("/pages/{i:int}", put_page, methods=["PUT"]),
        Route("/pages/{i:int}", get_page, methods=["GET"]),
        Route("/transfer", transfer_pages),
    ]
    return QuietRefusal(Starlette(routes=routes, lifespan=lifespan), stopping)


class QuietRefusal:
    """ASGI wrapper: a start-up the lifespan refused, and said why in one line, is not printed
    again as a traceback (Starlette sends the traceback text with ``lifespan.startup.failed``,
    and the server logs it); the server still fails its start-up (uvicorn exits 3)."""

    def __init__(self, app: Starlette, stopping: Stopping) -> None:
        self.app, self.stopping = app, stopping

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def quiet(message: Any) -> None:
            if message["type"] == "lifespan.startup.failed" and self.stopping.refused is not None:
                message = {**message, "message": ""}
            await send(message)

        await self.app(scope, receive, quiet if scope["type"] == "lifespan" else send)


def make_pool(
    args: argparse.Namespace,
    registry: CollectorRegistry,
    transfer: TransferEngine | None = None,
    tail: Tail | None = None,
) -> pinpool.PinnedPool:
    layout = layouts.MHA(
        args.kv_layout, layer_num=args.layer_num, page_size=args.page_size, head_num=args.head_num,
        head_dim=args.head_dim, dtype=torch.bfloat16,
    )  # fmt: skip
    runtime: str | pinpool.runtimes.Runtime = args.runtime
    extra: dict[str, Any] = {}
    fake = None
    if args.runtime == "fake-fail":
        # TESTING AID, not for production: a fake runtime (it pins nothing) whose third
        # registration fails (the last one in a pool of fewer), so the pool fails in the
        # background, after a visible moment of pinning where it has the chunks for one, at any
        # size. Its calls take a fixed 0.2 s, so no stall budget.
        runtime = fake = pinpool.testing.FakeRuntime(register_delay=0.2)
        extra = {"chunk_bytes": "256MiB", "max_retries": 0, "max_call_seconds": None}
    options: dict[str, Any] = {"max_call_seconds": args.max_call_seconds or None, "pin_nice": args.pin_nice} | extra
    if args.max_chunk_bytes is not None:
        options["max_chunk_bytes"] = args.max_chunk_bytes
    if tail is not None:  # --elastic: --size is the floor; the policy follows the host's memory pressure
        floor, step = pinpool.parse_size(args.size), pinpool.parse_size(args.grow_step)
        options |= {"reserve": args.elastic, "grow_step": step, "on_give_up": tail.give_up,
                    "elastic": pinpool.ElasticPolicy(floor=floor, step=step)}  # fmt: skip
    pool = pinpool.PinnedPool(
        layout=layout, size=args.size, runtime=runtime, background=True, name="kv-offload", registry=registry,
        registrars=[] if transfer is None else [transfer.registrar], **options,
    )  # fmt: skip
    if fake is not None:  # the plan is known now, and nothing is registered before the pool is entered
        fake.fail_register_on = frozenset({min(3, len(pool.plan.chunks))})
    if transfer is not None:
        transfer.planned(pool)
    if tail is not None:
        tail.pool = weakref.ref(pool)
    return pool


def serve_uvicorn(app: QuietRefusal, host: str, port: int, stopping: Stopping) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            stopping.stop()  # uploads still coming in end now (uvicorn's handler, on the main thread)
            super().handle_exit(sig, frame)

    # uvicorn handles SIGINT/SIGTERM itself (graceful shutdown, lifespan exit), restores the
    # handlers it found and then re-raises the signal. These handlers are the ones it finds,
    # so the re-raised signal is only noted and the process exits 0 after a clean shutdown.
    def noted(signum: int, frame: FrameType | None) -> None:
        log(f"{signal.Signals(signum).name} handled: graceful shutdown done")

    signal.signal(signal.SIGINT, noted)
    signal.signal(signal.SIGTERM, noted)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", access_log=False, timeout_graceful_shutdown=5, lifespan="on"
    )
    Server(config).run()


def serve_trio(app: QuietRefusal, host: str, port: int, stopping: Stopping) -> None:
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.graceful_timeout = 5.0

    async def main() -> None:
        # Opened before the lifespan starts, so a signal during start-up is kept, not lost.
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

            async def shutdown_trigger() -> None:
                async for signum in signals:
                    log(f"{signal.Signals(signum).name} received: graceful shutdown")
                    stopping.stop()
                    return

            await serve(app, config, shutdown_trigger=shutdown_trigger)  # type: ignore[arg-type]

    try:
        trio.run(main)
    except Exception:  # hypercorn raises a failed start-up out of trio.run (LifespanFailureError, in a group)
        if stopping.refused is None:
            raise
        sys.exit(3)  # already said in one line; 3 as uvicorn exits for a failed start-up


def tcp_port(value: str) -> int:
    """``--port``: a TCP port, checked here so a bad one is one line and exit 2, not a traceback from bind()."""
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a TCP port: give 1-65535 (0: any free port)")
    return port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A KV-cache offload server whose pool pins in the background.")
    parser.add_argument("--size", default="2GiB", help="pool size, e.g. 2GiB or 512GiB (default: 2GiB)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    parser.add_argument(
        "--port", type=tcp_port, default=DEFAULT_PORT, help=f"port to listen on (default: {DEFAULT_PORT})"
    )
    parser.add_argument(
        "--runtime", default="auto", choices=["auto", "cuda", "rocm", "mlock", "fake-fail"],
        help="pinning runtime (default: auto); fake-fail is a testing aid whose pinning fails",
    )  # fmt: skip
    parser.add_argument(
        "--max-call-seconds", type=float, default=0.05,
        help="stall budget: the longest one pinning call may hold the process's mmap lock or the CUDA driver "
        "lock (default: 0.05; 0 for none, which lets one call stall the serving thread for seconds)",
    )  # fmt: skip
    parser.add_argument(
        "--pin-nice", type=lambda v: v if v == "auto" else int(v), default="auto",
        help="how much nicer than the server the pin worker threads run: auto (the default: pinpool's level for a "
        "background pool), or 0-19 (0: the server's own priority, as before pin_nice existed)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-layout", default="page_first", choices=["page_first", "page_first_direct", "page_head", "layer_first"]
    )
    parser.add_argument("--layer-num", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--head-num", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--max-chunk-bytes", help="the largest pool chunk, e.g. 64MiB (default: pinpool's plan)")
    parser.add_argument(
        "--transfer-engine", choices=["mooncake", "nixl"], default=None,
        help="serve the pool's pages to peers through this engine on --host (Mooncake: TCP, P2P handshake; NIXL: "
        "UCX): GET /transfer?first=&count= says how to address them (default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--transfer-hold-last", action="store_true",
        help="testing aid: the engine registers the pool's last bytes only on SIGUSR1 (or shutdown)",
    )  # fmt: skip
    parser.add_argument("--trio", action="store_true", help="serve with hypercorn under trio instead of uvicorn")
    parser.add_argument(
        "--elastic", metavar="RESERVE",
        help="an elastic pool: --size is its floor, RESERVE the most it grows to; a write past the pinned pages asks "
        "for more, and under memory pressure it gives back the pages above the highest one written (default: fixed)",
    )  # fmt: skip
    parser.add_argument("--grow-step", default="64MiB", help="with --elastic: the segment it grows and shrinks by")
    args = parser.parse_args(argv)
    if args.transfer_hold_last and args.transfer_engine is None:
        parser.error("--transfer-hold-last holds a --transfer-engine registration: give --transfer-engine too")

    if args.transfer_engine is None:
        return serve(args, None)
    from kv_transfer import EngineError, TransferEngine

    try:
        transfer = TransferEngine(args.transfer_engine, args.host, hold_last=args.transfer_hold_last)
    except EngineError as error:
        log(f"cannot start the transfer engine: {error}")
        return 2
    log(f"transfer engine: {transfer}")
    try:
        status = serve(args, transfer)
    except SystemExit as exit:  # a failed start-up (3), as the servers report it
        status = exit.code if isinstance(exit.code, int) else 1
    finally:
        transfer.close()  # after the pool, which unregistered every range from it before unpinning
        log(f"transfer engine {args.transfer_engine} closed")
    if transfer.exits_hard:  # everything is done; its crash at exit would make the status a lie
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def serve(args: argparse.Namespace, transfer: TransferEngine | None) -> int:
    """The pool (registered with ``transfer`` too, when given) and the server, until it shuts down."""
    registry = CollectorRegistry()
    tail = Tail() if args.elastic else None
    try:
        pool = make_pool(args, registry, transfer, tail)
    except pinpool.PinpoolError as error:
        log(f"cannot create the pool: {error}")
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    stopping = Stopping()
    if transfer is not None and (held := transfer.held) is not None:
        stopping.on_stop.append(held.release)
        signal.signal(signal.SIGUSR1, lambda signum, frame: held.release())
    app = create_app(pool, registry, device, stopping, transfer, tail)
    (serve_trio if args.trio else serve_uvicorn)(app, args.host, args.port, stopping)
    # The lifespan has left the pool (unpinned, or rolled back); what the kernel still counts as
    # locked in this process should be nothing (under CUDA, pinned memory does not show in VmLck).
    log(f"shutdown VmLck={vm_locked_bytes()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
