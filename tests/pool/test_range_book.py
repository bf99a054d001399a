"""RangeBook (the process-wide book of pinned ranges, and the runtimes' books): one store per change."""

from __future__ import annotations

import linecache
import sys
from types import FrameType
from typing import Any

import pinpool._ranges as ranges_module
from pinpool._ranges import RangeBook

from .test_ki_sweep import a_new_pool_works


def test_a_raise_inside_a_range_book_update_leaves_it_whole_and_later_pools_work() -> None:
    """Finding 2: a KeyboardInterrupt between the two stores of ``RangeBook.add`` (a base inserted,
    its size not yet stored) made every later pool fail with ``KeyError``. Raised here from the
    trace function at every line of every update (models any exception, signal or not), except on
    a ``with self._lock:`` line: Python reports that line again when it calls ``__exit__``, and a
    raise from the trace there skips the lock's release (a trace artefact: a real signal is
    handled after that call, once the lock is released)."""
    source = ranges_module.__file__

    for method, args in (("add", (1 << 40, 4096)), ("add_all", ([(1 << 41, 4096), (1 << 41 | 8192, 4096)],))):
        book = RangeBook()
        book.add(1 << 39, 4096)
        lines = 0
        k = 0
        while True:
            k += 1
            count = [0]

            def trace(frame: FrameType, event: str, arg: object, _k: int = k, _count: list[int] = count) -> Any:
                if frame.f_code.co_filename != source:
                    return None
                if event == "line" and not linecache.getline(source, frame.f_lineno).strip().startswith("with "):
                    _count[0] += 1
                    if _count[0] == _k:
                        raise KeyboardInterrupt
                return trace

            previous = sys.gettrace()  # coverage's tracer, under --cov: put back, or the worker stops measuring
            sys.settrace(trace)
            try:
                getattr(book, method)(*args)
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(previous)
            if count[0] < k:
                break  # this k was past the update's last line: every line was hit
            lines += 1
            snap = book.snapshot()
            first = args[0] if method == "add" else args[0][0][0]
            assert book.get(1 << 39) == 4096
            assert book.pop(first) in (None, 4096, 8192), snap  # absent, or there whole
            assert book.snapshot() == {1 << 39: 4096}, (method, k, snap)
            assert book.add(first, 4096) is None and book.pop(first) == 4096
        assert lines > 2

    a_new_pool_works()
