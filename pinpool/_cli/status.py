"""What a command says on stderr while it works, apart from pin's progress: status lines, and the
note a terminal shows while torch loads (importing it takes seconds; a blank screen that long
looks like a hang). stdout carries only the report, so pipes and ``--json`` are unaffected."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TextIO


def say(text: str, stream: TextIO | None = None) -> None:
    """A status line on stderr (progress and notes go there; the report goes to stdout)."""
    print(text, file=sys.stderr if stream is None else stream, flush=True)


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(callable(isatty) and isatty())


@contextlib.contextmanager
def while_loading(what: str, stream: TextIO | None = None) -> Iterator[None]:
    """On a terminal, ``pinpool: <what>...`` for as long as the block runs, then taken off the
    line so the output starts clean; elsewhere (a pipe, a log) nothing: a log keeps no note
    that only said "wait". A failing stream never fails the command."""
    out = sys.stderr if stream is None else stream
    note = f"pinpool: {what}..."
    shown = False
    if _isatty(out):
        with contextlib.suppress(OSError, ValueError):
            out.write(note)
            out.flush()
            shown = True
    try:
        yield
    finally:
        if shown:
            # Padding over the note, not an escape sequence: works on any terminal.
            with contextlib.suppress(OSError, ValueError):
                out.write("\r" + " " * len(note) + "\r")
                out.flush()
