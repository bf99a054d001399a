"""Unpinning, a mixin of :class:`~pinpool._pin.engine.PinSession` (one object, one lock): batches from
one reverse-order queue, each chunk unregistered piece by piece, the results landed on the books."""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import RuntimeCallError
from .._plan.chunks import Chunk
from .pipeline import take_batch

if TYPE_CHECKING:
    import threading

    from .._observe import Observer
    from .engine import Answer, _Op
    from .ledger import Ledger, RegistrationBook


@dataclass(frozen=True)
class _Unpinned:
    """What unregistering one chunk (all its pieces) did."""

    index: int
    error: RuntimeCallError | None
    seconds: float
    released: tuple[tuple[Chunk, RuntimeCallError], ...] = ()  # someone else released them: not a failure
    absent: tuple[tuple[Chunk, RuntimeCallError], ...] = ()  # "maybe" pieces never registered: nothing to undo


class Unpinning:
    """The unpin workers' calls, for :class:`~pinpool._pin.engine.PinSession`, which provides these."""

    ledger: Ledger
    book: RegistrationBook
    lock: threading.Lock
    observer: Observer
    base_ptr: int
    unpin_workers: int
    _unregister: _Op
    _not_registered: frozenset[int]

    def _call(self, op: _Op, offset: int, nbytes: int) -> tuple[Answer, float]:
        raise NotImplementedError  # PinSession's one call wrapper

    def _claim_unpin_batch(self, pending: collections.deque[int]) -> list[int]:
        """The next chunks to unregister, a batch from the shared reverse-order queue."""
        chunks = self.ledger.chunks
        with self.lock:
            share = -(-len(pending) // max(1, self.unpin_workers))
            return take_batch(lambda: pending.popleft() if pending else None, lambda i: chunks[i].nbytes, share)

    def _unregister_chunk(self, index: int) -> _Unpinned:
        """Unregister one chunk, piece by piece where it was registered in pieces, each by its own base."""
        chunk = self.ledger.chunks[index]
        error: RuntimeCallError | None = None
        released: list[tuple[Chunk, RuntimeCallError]] = []
        absent: list[tuple[Chunk, RuntimeCallError]] = []
        started = time.perf_counter()
        for piece in reversed(self.ledger.pieces.get(index, (chunk,))):
            answer, _seconds = self._call(self._unregister, piece.offset, piece.nbytes)
            failure = answer.error
            if failure is not None and failure.code in self._not_registered:
                # No registration at this base (never made, or released by someone else): nothing is
                # pinned there, so keeping the memory mapped would only leak it.
                (absent if piece in self.ledger.maybe else released).append((piece, failure))
                failure = None
            if failure is None:
                self.book.unregistered(index, chunk, piece)  # a piece whose unregister failed stays listed
            else:  # anything, SystemExit included, fails this chunk only
                error = error or failure
        return _Unpinned(index, error, time.perf_counter() - started, tuple(released), tuple(absent))

    def _land_unpinned(
        self, pending: collections.deque[int], done: Sequence[_Unpinned], unstarted: Sequence[int]
    ) -> None:
        """Put ``done`` on the books; claimed chunks not unregistered when something interrupted
        the worker (``unstarted``) go back to the queue (the inline runner resumes it)."""
        ledger, observer = self.ledger, self.observer
        if unstarted:
            with self.lock:
                pending.extendleft(reversed(unstarted))
        if not done:
            return
        with self.lock:
            before = ledger.pinned_bytes
            for unpinned in done:
                ledger.released_elsewhere.extend(piece for piece, _answer in unpinned.released)
                if unpinned.error is None:
                    ledger.unregistered(unpinned.index)
                else:
                    ledger.unregister_failed(unpinned.index, unpinned.error)
            moved = ledger.pinned_bytes - before
        observer.pinned_moved(moved)
        for unpinned in done:
            for piece, answer in unpinned.released:
                observer.released_elsewhere(piece, self.base_ptr + piece.offset, answer)
            for piece, answer in unpinned.absent:
                observer.not_registered(piece, self.base_ptr + piece.offset, answer)
            chunk = ledger.chunks[unpinned.index]
            if unpinned.error is None:
                observer.chunk_unregistered(chunk, unpinned.seconds)
            else:
                observer.chunk_failed(chunk, "unregister", unpinned.error, unpinned.seconds)
