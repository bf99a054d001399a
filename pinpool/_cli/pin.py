"""``pinpool pin``: pin a pool with progress, hold it, report, unpin; and how every command takes SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from .._errors import ConfigError
from .._host import libc as _libc
from .._units import format_bytes
from .options import hold_seconds, layout_from_args, runtime_arg, text_options
from .progress import EXIT_OK, EventLog, ProgressReporter, ResidentGrowth, isatty, say
from .report import pin_report, pin_text

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from .._pool.pool import PinnedPool

METRICS_PORT = 9464  # the port every pinpool dashboard and doc uses
ROLLED_BACK_NOTE = "pinning stopped and was rolled back: nothing is pinned"
UNPINNED_NOTE = "the pool was unpinned before exit"
PROGRESS_SECONDS = 0.1  # how often a background pool's progress is drawn while pin waits for it
CTRL_C = "Ctrl-C"
SIGTERM = "SIGTERM"


class Interrupts:
    """How the command takes SIGTERM (and Ctrl-C, while Python's own handler has it): armed, a signal raises
    KeyboardInterrupt in the main thread, so pinning rolls back; else (torch's import, the teardown and the
    unmapping finalizer would lose it) it is recorded, for :meth:`arm` or ``main`` to raise."""

    def __init__(self) -> None:
        self.armed = False
        self.pending: str | None = None  # the signal that arrived while deferred ("SIGTERM", "Ctrl-C")
        self.stopping = False  # a signal ended a hold: later ones repeat that request

    def arm(self) -> None:
        """Raise from now on, and now if a signal was recorded meanwhile."""
        self.armed = True  # first: a signal between the two lines is raised by the handler, once
        if self.pending is not None:
            self.armed = False
            what, self.pending = self.pending, None
            raise KeyboardInterrupt(what)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        what = SIGTERM if signum == signal.SIGTERM else CTRL_C
        if self.armed:
            self.armed = False  # before raising: whatever the exception unwinds through is not interrupted again
            raise KeyboardInterrupt(what)
        if self.pending is None and not self.stopping:
            self.pending = what

    def defer(self) -> None:
        self.armed = False


_interrupts: Interrupts | None = None  # the running command's, while main() runs on the main thread


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[Interrupts | None]:
    """:class:`Interrupts` for SIGTERM (and SIGINT unless handled elsewhere) until the block ends; None off main."""
    global _interrupts
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    interrupts = Interrupts()
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, interrupts.handle)}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupts.handle)
    outer, _interrupts = _interrupts, interrupts
    try:
        yield interrupts
    finally:
        _interrupts = outer
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def first_line(kwargs: dict[str, Any]) -> str:
    """What pin says before importing torch (seconds): the pool it is about to pin."""
    what = format_bytes(kwargs["size"]) if "size" in kwargs else f"{kwargs.get('num_pages')} pages"
    return f"pinpool: preparing to pin {what} (pool {kwargs.get('name', 'cli')!r}): loading torch"


def _serve_metrics(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, str]:
    from prometheus_client import start_http_server

    if not 0 <= port <= 65535:
        raise ConfigError(f"--metrics-port {port}: give a TCP port (0-65535; {METRICS_PORT} is pinpool's usual)")
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(
            f"--metrics-host {host} --metrics-port {port}: cannot serve metrics there ({exc.strerror or exc}); "
            "pick a free port, or a host address of this machine"
        ) from None
    shown = f"[{host}]" if ":" in host else host
    return server, f"http://{shown}:{server.server_port}/metrics"


def hold(seconds: float, pool: PinnedPool, url: str | None) -> str:
    """Keep the pool pinned; ``"time"`` when the hold ran out, else the signal that ended it."""
    until = "until Ctrl-C or SIGTERM" if seconds == float("inf") else f"for {seconds:g} s (Ctrl-C or SIGTERM ends it)"
    try:
        say(f"pinpool: holding {format_bytes(pool.nbytes)} pinned {until}" + (f"; metrics at {url}" if url else ""))
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 3600.0))
    except KeyboardInterrupt as exc:  # the usual way to end a hold: unpin and exit 0
        if _interrupts is not None:
            _interrupts.stopping = True  # a second signal while unpinning asks the same: still exit 0
        # Our handler names the signal; Python's own SIGINT handler raises a bare KeyboardInterrupt (Ctrl-C).
        what = str(exc.args[0]) if exc.args and exc.args[0] else CTRL_C
        return "SIGINT" if what == CTRL_C else what
    return "time"


class _PinEvents(EventLog):
    """The pool's events; ``announce`` runs at ``pool.pin.start``, so a pool that fails its pre-flight says nothing."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self.announce: Callable[[], None] = lambda: None

    def info(self, event: str, **fields: Any) -> None:
        if event == "pool.pin.start":
            self.announce()
        super().info(event, **fields)


def _wait_ready(pool: PinnedPool, progress: ProgressReporter) -> None:
    """Wait for a background pool, drawing progress from it (its threads report to nobody)."""
    while True:
        try:
            pool.wait_ready_sync(timeout=PROGRESS_SECONDS)
        except TimeoutError:
            progress(pool.pinned_bytes, pool.nbytes, 0, len(pool.plan.chunks))
            continue
        progress(pool.nbytes, pool.nbytes, len(pool.plan.chunks), len(pool.plan.chunks))
        return


def run_pin(args: argparse.Namespace, stderr: TextIO | None = None) -> int:
    err = sys.stderr if stderr is None else stderr
    kwargs = text_options(args, "pin")
    hold_for = hold_seconds(args.hold)
    mode = args.progress if args.progress != "auto" else "bar" if isatty(err) else "lines"
    interrupts = _interrupts
    if interrupts is not None:
        interrupts.defer()  # until the pool is built: torch's import must not see a KeyboardInterrupt
    # Only when the wait is torch's import (main() called in a process that has torch does not wait).
    if mode != "none" and "torch" not in sys.modules:
        say(first_line(kwargs), err)
    kwargs["layout"] = layout_from_args(args)  # imports torch
    from prometheus_client import CollectorRegistry

    from .._pool.pool import PinnedPool

    registry = CollectorRegistry()  # the pool's own: the summary reads it, --metrics-port serves it
    events = _PinEvents(err)
    progress = ProgressReporter(err, mode)
    kwargs["runtime"] = runtime_arg(kwargs.get("runtime", "auto"))
    pool = PinnedPool(**kwargs, registry=registry, logger=events, on_progress=progress)
    if interrupts is not None:
        interrupts.arm()  # a Ctrl-C or SIGTERM that came meanwhile ends the command here: nothing is pinned
    server, url = (None, None) if args.metrics_port is None else _serve_metrics(registry, args.metrics_host,
                                                                                 args.metrics_port)  # fmt: skip
    try:
        return _pin_and_report(args, pool, progress, events, registry, hold_for, url)
    finally:
        progress.finish()
        if server is not None:
            server.shutdown()
            server.server_close()


def faulted_bytes(pool: PinnedPool, registry: CollectorRegistry) -> Any:
    """Bytes faulted so far, to move the display within a chunk: populated or resident, whichever is further."""
    labels = {"pool": pool.name, "runtime": pool.runtime.name}
    resident = ResidentGrowth()  # from now: the pool is constructed, its memory not yet faulted

    def faulted() -> int:
        counted = registry.get_sample_value("pinpool_populated_bytes_total", labels) or 0.0
        return max(int(counted), resident() or 0)

    return faulted


def _pin_and_report(args: argparse.Namespace, pool: PinnedPool, progress: ProgressReporter, events: _PinEvents,
                    registry: CollectorRegistry, hold_for: float | None, url: str | None) -> int:  # fmt: skip
    if progress.mode != "none":
        events.announce = lambda: say(
            f"pinpool: pinning {format_bytes(pool.nbytes)} in {len(pool.plan.chunks)} chunk(s) of <= "
            f"{format_bytes(pool.plan.chunk_bytes)} with runtime {pool.runtime.name!r} (pool {pool.name!r})",
            progress.stream,
        )
    held: tuple[float, str] | None = None
    entered = False
    before = _libc.vm_locked_bytes()
    progress.faulted = faulted_bytes(pool, registry)
    progress.restart()
    try:
        with pool:
            try:
                entered = True
                if args.background:  # the pool pins while this waits
                    _wait_ready(pool, progress)
                progress.finish()
                during = _libc.vm_locked_bytes()
                if hold_for is not None:
                    started = time.monotonic()
                    ended_by = hold(hold_for, pool, url)
                    held = (time.monotonic() - started, ended_by)
            finally:
                if _interrupts is not None:  # the pool unpins and unmaps uninterrupted; a signal now is recorded
                    _interrupts.defer()
        interrupts = _interrupts
        if interrupts is not None and interrupts.pending is not None:
            raise KeyboardInterrupt(interrupts.pending)  # it arrived while the pool was unpinned
    except KeyboardInterrupt as exc:
        exc.add_note(UNPINNED_NOTE if entered else ROLLED_BACK_NOTE)
        raise
    after = _libc.vm_locked_bytes()
    report = pin_report(pool, events, registry, (before, during, after), held)
    print(json.dumps(report) if args.json else "\n".join(pin_text(report)))
    return EXIT_OK
