"""What a command tells people on stderr (status lines, pin's progress, per-call latency), and the
exit statuses; stdout carries only the report. Rendering is pure, so tests need no terminal or clock.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from .._units import format_bytes, format_rate

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_PIN_FAILED = 3
EXIT_INTERRUPTED = 130
EXIT_PIPE = 141

EXIT_CODES = """\
exit status:
  0    success; for pin --hold, also when Ctrl-C or SIGTERM ends the hold (the pool is unpinned first)
  1    doctor: a check failed; pin: unpinning failed
  2    bad input: usage error, ConfigError (size, layout, option, environment variable),
       or a metrics address that cannot be served
  3    pinning failed and was rolled back (PinError), or the memory could not be mapped or is already pinned
  130  interrupted (Ctrl-C or SIGTERM) and rolled back, or interrupted while the pool was unpinned
       at the end (it finishes unpinning first): nothing stays pinned
  141  stdout was closed early (e.g. piped into head)"""

LINE_INTERVAL_SECONDS = 2.0  # plain log lines: often enough to show life, rare enough for a TiB pin
RATE_WINDOW_SECONDS = 2.0  # shows a stall or a speed-up, yet chunk-sized steps do not make it flicker
_BAR_MIN, _BAR_MAX = 10, 40


def eta_seconds(pinned: int, total: int, elapsed: float, rate: float | None = None) -> float | None:
    """Seconds left at ``rate`` (bytes/s; None: the average so far); None while unknown or stalled."""
    if total > 0 and pinned >= total:
        return 0.0
    if rate is not None:
        return None if rate <= 0 else max(0.0, (total - pinned) / rate)
    if pinned <= 0 or elapsed <= 0:
        return None
    return max(0.0, (total - pinned) * elapsed / pinned)


def _speed(pinned: int, elapsed: float, rate: float | None) -> str:  # labelled: not the report's whole-pin rate
    return f"{format_rate(rate)} recent" if rate is not None else f"{format_rate(pinned, elapsed)} average"


def format_eta(seconds: float | None) -> str:
    """``0:07``, ``12:34``, ``1:02:03``; ``--:--`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "--:--"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _percent(pinned: int, total: int) -> int:  # floor: 100% means every byte is pinned
    return 100 if total <= 0 else min(100, pinned * 100 // total)


def _ahead(pinned: int, faulted: int | None) -> int | None:
    """Faulted bytes worth showing: only while they run ahead of the pinned ones."""
    return faulted if faulted is not None and faulted > pinned else None


def render_bar(pinned: int, total: int, elapsed: float, done: int, chunks: int, width: int = 80,
               faulted: int | None = None, rate: float | None = None) -> str:  # fmt: skip
    """One terminal line: ``pinning [####++....]  40%  1.6 GiB / 4 GiB  5.21 GB/s recent  ETA 0:01  6/16 chunks``;
    ``+`` is faulted but not yet pinned, ``rate`` bytes/s now (None: the average so far)."""
    ahead = _ahead(pinned, faulted)
    figures = (
        f" {_percent(pinned, total):3d}%  {format_bytes(pinned)} / {format_bytes(total)}"
        + (f" ({format_bytes(ahead)} faulted)" if ahead is not None else "")
        + f"  {_speed(pinned, elapsed, rate)}  ETA {format_eta(eta_seconds(pinned, total, elapsed, rate))}"
        f"  {done}/{chunks} chunks"
    )
    cells = max(_BAR_MIN, min(_BAR_MAX, width - len(figures) - len("pinning []") - 1))

    def fill(nbytes: int) -> int:
        return cells if total <= 0 else min(cells, nbytes * cells // total)

    hashes = fill(pinned)
    pluses = fill(ahead) - hashes if ahead is not None else 0
    return f"pinning [{'#' * hashes}{'+' * pluses}{'.' * (cells - hashes - pluses)}]{figures}"


def render_line(pinned: int, total: int, elapsed: float, done: int, chunks: int, faulted: int | None = None,
                rate: float | None = None) -> str:  # fmt: skip
    """One plain log line, for stderr that is not a terminal (``rate`` as for :func:`render_bar`)."""
    ahead = _ahead(pinned, faulted)
    return (
        f"pinpool: pinning {_percent(pinned, total)}% ({format_bytes(pinned)} of {format_bytes(total)}"
        + (f", {format_bytes(ahead)} faulted" if ahead is not None else "")
        + f"), {_speed(pinned, elapsed, rate)}, ETA {format_eta(eta_seconds(pinned, total, elapsed, rate))}, "
        f"{done}/{chunks} chunks, {elapsed:.1f} s elapsed"
    )


class RecentRate:
    """Bytes per second over about the last ``window`` seconds."""

    def __init__(self, window: float = RATE_WINDOW_SECONDS) -> None:
        self.window = window
        self._samples: deque[tuple[float, int]] = deque()

    def restart(self, now: float) -> None:
        self._samples.clear()
        self._samples.append((now, 0))

    def __call__(self, now: float, moved: int) -> float | None:
        """Record ``moved`` at ``now``; the rate since the newest sample ``window`` old (else the oldest)."""
        samples = self._samples
        samples.append((now, moved))
        while len(samples) > 2 and now - samples[1][0] >= self.window:
            samples.popleft()
        then, before = samples[0]
        if now - then <= 0:
            return None
        return max(0.0, (moved - before) / (now - then))


class ResidentGrowth:
    """Bytes this process's resident memory grew by since :meth:`restart` (None where unreadable): it
    moves page by page as a pool faults, where the populated counter moves a whole span."""

    def __init__(self, path: str = "/proc/self/statm") -> None:
        self.path = path
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._base = self._resident()

    def _resident(self) -> int | None:
        try:
            with open(self.path) as f:
                return int(f.read().split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            return None

    def restart(self) -> None:
        self._base = self._resident()

    def __call__(self) -> int | None:
        now = self._resident()
        if now is None or self._base is None:
            return None
        return max(0, now - self._base)


class ProgressReporter:
    """The ``on_progress`` callback: a bar redrawn with ``\\r`` (``mode="bar"``), plain lines every ``interval``
    seconds (``"lines"``), or nothing (``"none"``); ``faulted()`` moves the display within a chunk. It never
    raises an ``Exception`` (that would roll pinning back): a failing stream only ends the display."""

    def __init__(self, stream: TextIO, mode: str, *, interval: float = LINE_INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.monotonic, width: int | None = None,
                 faulted: Callable[[], float | None] | None = None,
                 window: float = RATE_WINDOW_SECONDS) -> None:  # fmt: skip
        if mode not in ("bar", "lines", "none"):
            raise ValueError(f"mode={mode!r}: choose 'bar', 'lines' or 'none'")
        self.stream = stream
        self.mode = mode
        self.interval = interval
        self._clock = clock
        self._width = width
        self.faulted = faulted
        self._rate = RecentRate(window)
        self.restart()
        self._drawn = 0  # characters of the bar now on screen (0: none)
        self._finished_line = False
        self._broken = False

    def restart(self) -> None:  # the pin starts after the pool is constructed
        self._start = self._last_line = self._clock()
        self._rate.restart(self._start)

    def __call__(self, pinned: int, total: int, done: int, chunks: int) -> None:
        if self.mode == "none" or self._broken:
            return
        try:
            self._update(pinned, total, done, chunks)
        except Exception:  # never raise into the pin: that would roll it back
            self._broken = True

    def _update(self, pinned: int, total: int, done: int, chunks: int) -> None:
        now = self._clock()
        elapsed = now - self._start
        read = self.faulted() if self.faulted is not None else None
        faulted = None if read is None else min(total, int(read))
        rate = self._rate(now, max(pinned, faulted or 0))
        if self.mode == "bar":
            width = self._width or shutil.get_terminal_size((80, 24)).columns
            text = render_bar(pinned, total, elapsed, done, chunks, width=width - 1, faulted=faulted, rate=rate)
            # Pad over a longer previous line instead of an escape sequence: works on any terminal.
            self.stream.write("\r" + text.ljust(self._drawn))
            self.stream.flush()
            self._drawn = len(text)
            return
        complete = total > 0 and pinned >= total
        if complete and self._finished_line:
            return
        if complete or now - self._last_line >= self.interval:
            self._last_line = now
            self._finished_line = complete
            self.stream.write(render_line(pinned, total, elapsed, done, chunks, faulted, rate) + "\n")
            self.stream.flush()

    def finish(self) -> None:  # the bar off the screen, so what follows starts on a clean line
        if self._drawn and not self._broken:
            try:
                self.stream.write("\r" + " " * self._drawn + "\r")
                self.stream.flush()
            except Exception:
                self._broken = True
        self._drawn = 0


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100): an observed value, never an interpolation."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def format_seconds(seconds: float) -> str:
    """``0.42 ms``, ``12.3 ms``, ``1.25 s``: latencies span microseconds (lock-on-fault) to seconds (CUDA)."""
    if seconds < 1.0:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


class EventLog:
    """A structlog-shaped logger for ``PinnedPool(logger=...)``, called by worker threads: keeps each
    ``chunk.registered`` event's ``seconds``, prints warnings and errors but ``quiet`` ones as one line."""

    def __init__(self, stream: TextIO, *, quiet: frozenset[str] = frozenset({"pool.rollback"})) -> None:
        self.stream = stream
        self.quiet = quiet
        self.register_seconds: list[float] = []
        self.retries = 0
        self._context: dict[str, Any] = {}
        self._lock = threading.Lock()

    def bind(self, **context: Any) -> EventLog:  # one pool per log: its labels go into what warnings print
        self._context.update(context)
        return self

    def debug(self, event: str, **fields: Any) -> None:
        if event == "chunk.registered":
            self.register_seconds.append(float(fields.get("seconds", 0.0)))

    def info(self, event: str, **fields: Any) -> None:
        if event == "chunk.retry":
            with self._lock:
                self.retries += 1

    def warning(self, event: str, **fields: Any) -> None:
        self._print("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._print("error", event, fields)

    def _print(self, level: str, event: str, fields: dict[str, Any]) -> None:
        if event in self.quiet:
            return
        pool = self._context.get("pool", "?")
        details = ", ".join(f"{key}={value!r}" for key, value in fields.items())
        try:
            self.stream.write(f"pinpool: pool {pool!r}: {level}: {event}" + (f" ({details})" if details else "") + "\n")
            self.stream.flush()
        except Exception:
            pass  # stderr is gone; the summary and exit status still say what happened


def say(text: str, stream: TextIO | None = None) -> None:  # a status line on stderr
    print(text, file=sys.stderr if stream is None else stream, flush=True)


def isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(callable(isatty) and isatty())


@contextlib.contextmanager
def while_loading(what: str, stream: TextIO | None = None) -> Iterator[None]:
    """On a terminal, ``pinpool: <what>...`` while the block runs (torch takes seconds to import: a
    blank screen that long looks like a hang), then wiped; in a log nothing. Never fails the command."""
    out = sys.stderr if stream is None else stream
    note = f"pinpool: {what}..."
    shown = False
    if isatty(out):
        with contextlib.suppress(OSError, ValueError):
            out.write(note)
            out.flush()
            shown = True
    try:
        yield
    finally:
        if shown:  # padding over the note, not an escape sequence: works on any terminal
            with contextlib.suppress(OSError, ValueError):
                out.write("\r" + " " * len(note) + "\r")
                out.flush()
