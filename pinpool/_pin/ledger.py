"""The ledger: which chunks are registered, and what rollback or teardown must undo. A pure state
machine called under the session's lock: every decision (next chunk, stop, what to unregister in
which order, what leaked) is a transition here, so every path is unit-testable."""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence

from .._errors import ChunkFailure, LedgerError, RuntimeCallError
from .._plan.chunks import Chunk, ChunkTable


class ChunkState(enum.Enum):
    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    FAULTING = "faulting"  # registered lock-on-fault, pages still being faulted: undo it, but not pinned yet
    REGISTERED = "registered"
    FAILED = "failed"  # its register (or populate) call failed: nothing to undo
    UNREGISTERED = "unregistered"
    LEAKED = "leaked"  # unregistering it failed: it may still be pinned


_UNDO = frozenset({ChunkState.REGISTERED, ChunkState.FAULTING})  # teardown undoes their registration


class Phase(enum.Enum):
    PINNING = "pinning"
    PINNED = "pinned"
    ROLLED_BACK = "rolled_back"  # pinning failed or was cancelled; teardown pending or done
    CLOSED = "closed"


class StopCause(enum.Enum):
    """Why the books stopped handing out chunks (the first cause wins)."""

    FAILURE = "failure"  # a populate or register call failed
    CANCELLED = "cancelled"  # the caller was interrupted (cancellation, Ctrl-C, on_progress raised)
    EXIT = "exit"  # a background pool's body left, or the interpreter exits, while it pinned
    COLLECTED = "collected"  # a background pool's façade was garbage-collected while it pinned


class Ledger:
    """Bookkeeping for one buffer's chunks through pin, rollback and teardown."""

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        self.chunks: Sequence[Chunk] = chunks if isinstance(chunks, ChunkTable) else tuple(chunks)
        self.states: list[ChunkState] = [ChunkState.PENDING] * len(self.chunks)
        self.phase = Phase.PINNING
        self.stop_cause: StopCause | None = None
        self.failures: list[ChunkFailure] = []
        self.pieces: dict[int, tuple[Chunk, ...]] = {}  # chunks registered as several calls (retries)
        self.released_elsewhere: list[Chunk] = []  # found released by someone else: unregistered, not leaked
        self.maybe: set[Chunk] = set()  # failed untrusted (engine.untrusted_call): undone at teardown, never pinned
        self._next = 0
        self.in_flight = 0
        self.registered_bytes = 0  # chunks that count whole now, and leaked ones (maybe still pinned)
        self.chunks_done = 0  # counted, not summed: progress is read every tick
        self._part_bytes: dict[int, int] = {}  # pinned bytes of chunks not counted whole (yet, or ever)
        self._part_total = 0
        self.pending = len(self.chunks)  # not yet handed out (nor failed before their registration)

    def claim(self) -> int | None:
        """Hand out the next pending chunk's index, or ``None`` when there is nothing to do."""
        if self.phase is not Phase.PINNING or self.stop_cause is not None:
            return None
        while self._next < len(self.chunks) and self.states[self._next] is not ChunkState.PENDING:
            self._next += 1
        if self._next >= len(self.chunks):
            return None
        self._next += 1
        self.claim_index(self._next - 1)
        return self._next - 1

    def claim_index(self, index: int) -> None:
        """Claim one particular pending chunk (a pipeline registers whichever chunk is ready)."""
        if self.phase is not Phase.PINNING or self.stop_cause is not None:
            raise LedgerError(f"claim of chunk {index} after pinning stopped")
        if self.states[index] is not ChunkState.PENDING:
            raise LedgerError(f"claim of chunk {index}, which is {self.states[index].value}")
        self.states[index] = ChunkState.IN_FLIGHT
        self.in_flight += 1
        self.pending -= 1

    def unclaim(self, index: int) -> None:
        """A claimed chunk whose call was never made (its worker's batch stopped): pending again."""
        if self.states[index] is not ChunkState.IN_FLIGHT:
            raise LedgerError(f"unclaim of chunk {index}, which is {self.states[index].value}")
        self.states[index] = ChunkState.PENDING
        self.in_flight -= 1
        self.pending += 1
        self._next = min(self._next, index)

    def registered(self, index: int, *, faulting: bool = False) -> None:
        """A chunk's registration returned; ``faulting`` (lock-on-fault): pinned once :meth:`faulted`."""
        self._land(index, ChunkState.FAULTING if faulting else ChunkState.REGISTERED)
        if not faulting:
            self._count_whole(index)

    def faulted(self, index: int) -> None:
        """Every page of a lock-on-fault chunk is faulted in, so locked: it is pinned now."""
        if self.states[index] is not ChunkState.FAULTING:
            raise LedgerError(f"chunk {index} faulted but was {self.states[index].value}")
        self.states[index] = ChunkState.REGISTERED
        self._count_whole(index)

    def _count_whole(self, index: int) -> None:
        self._drop_part(index)  # from here the chunk counts whole
        self.registered_bytes += self.chunks[index].nbytes
        self.chunks_done += 1

    def pinned_part(self, index: int, nbytes: int) -> None:
        """``nbytes`` more of chunk ``index`` are pinned, before (or without) the chunk counting whole."""
        self._part_bytes[index] = self._part_bytes.get(index, 0) + nbytes
        self._part_total += nbytes

    def _drop_part(self, index: int) -> None:
        self._part_total -= self._part_bytes.pop(index, 0)

    def partly_registered(
        self, index: int, pieces: Sequence[Chunk], attempts: Sequence[ChunkFailure], *, pinned: bool = True,
        maybe: Sequence[Chunk] = (),
    ) -> None:  # fmt: skip
        """A chunk failed or stopped with ``pieces`` (and ``maybe`` ranges) of it registered: teardown undoes them."""
        self._land(index, ChunkState.FAULTING)  # undone by teardown, never counted whole
        self.pieces[index] = (*pieces, *maybe)
        self.maybe.update(maybe)
        if pinned:  # all of them: progress landed only some (retry halves land none)
            self._drop_part(index)
            self.pinned_part(index, sum(piece.nbytes for piece in pieces))
        self.failures.extend(attempts)
        self.stop_cause = self.stop_cause or StopCause.FAILURE

    def failed(self, index: int, phase: str, error: RuntimeCallError, attempts: Sequence[ChunkFailure] = ()) -> None:
        """A chunk's populate or register call failed: record it and stop handing out chunks."""
        self._land(index, ChunkState.FAILED)
        self.failures.extend(attempts or [ChunkFailure(self.chunks[index], phase, error)])
        self.stop_cause = self.stop_cause or StopCause.FAILURE

    def populate_failed(self, index: int, error: RuntimeCallError) -> None:
        """Pre-faulting part of a chunk failed, before its registration or after it (lock-on-fault)."""
        state = self.states[index]
        if state is ChunkState.PENDING:
            self.states[index] = ChunkState.FAILED
            self.pending -= 1
        elif state not in (ChunkState.FAULTING, ChunkState.FAILED):  # FAILED: another of its spans failed too
            raise LedgerError(f"populate of chunk {index} failed while it was {state.value}")
        self.failures.append(ChunkFailure(self.chunks[index], "populate", error))
        self.stop_cause = self.stop_cause or StopCause.FAILURE

    def cancel(self) -> None:
        self.stop(StopCause.CANCELLED)

    def stop(self, cause: StopCause) -> None:
        """Stop handing out chunks, for ``cause`` (first cause wins; no effect once pinning ended)."""
        if self.stop_cause is None and self.phase is Phase.PINNING:
            self.stop_cause = cause

    def _land(self, index: int, state: ChunkState) -> None:
        if self.states[index] is not ChunkState.IN_FLIGHT:
            raise LedgerError(f"chunk {index} landed as {state.value} but was {self.states[index].value}")
        self.states[index] = state
        self.in_flight -= 1

    @property
    def pinned_bytes(self) -> int:
        """Bytes pinned now: the one figure of ``pool.pinned_bytes``, the gauge and a failure's text."""
        return self.registered_bytes + self._part_total

    def finish_pinning(self) -> Phase:
        """Close the pinning phase once no call is in flight; PINNED only if every chunk registered."""
        if self.phase is not Phase.PINNING:
            raise LedgerError(f"finish_pinning in phase {self.phase.value}")
        if self.in_flight:
            raise LedgerError(f"finish_pinning with {self.in_flight} chunks still in flight")
        complete = self.chunks_done == len(self.chunks)
        self.phase = Phase.PINNED if complete and self.stop_cause is None else Phase.ROLLED_BACK  # a stop still wins
        return self.phase

    def abort(self) -> Phase:
        """End pinning with calls in flight though every thread is done (a pinpool bug): those failed."""
        if self.phase is not Phase.PINNING:
            raise LedgerError(f"abort in phase {self.phase.value}")
        for index, state in enumerate(self.states):
            if state is ChunkState.IN_FLIGHT:
                self.states[index] = ChunkState.FAILED
        self.in_flight = 0
        self.stop_cause = self.stop_cause or StopCause.FAILURE
        self.phase = Phase.ROLLED_BACK
        return self.phase

    def teardown_order(self) -> list[int]:
        """Indices to unregister, in reverse offset order; empty once closed (teardown is idempotent)."""
        if self.phase is Phase.PINNING:
            raise LedgerError("teardown while still pinning: finish_pinning first")
        if self.phase is Phase.CLOSED:
            return []
        return [i for i in range(len(self.chunks) - 1, -1, -1) if self.states[i] in _UNDO]

    def unregistered(self, index: int) -> None:
        self._unland(index, ChunkState.UNREGISTERED)

    def unregister_failed(self, index: int, error: RuntimeCallError) -> None:
        self._unland(index, ChunkState.LEAKED)
        self.failures.append(ChunkFailure(self.chunks[index], "unregister", error))

    def _unland(self, index: int, state: ChunkState) -> None:
        if self.phase not in (Phase.PINNED, Phase.ROLLED_BACK):
            raise LedgerError(f"unregister in phase {self.phase.value}")
        was = self.states[index]
        if was not in _UNDO:
            raise LedgerError(f"chunk {index} unregistered but was {was.value}")
        self.states[index] = state
        if was is ChunkState.REGISTERED:
            self.chunks_done -= 1
        if state is ChunkState.UNREGISTERED and was is ChunkState.REGISTERED:
            self.registered_bytes -= self.chunks[index].nbytes
        elif state is ChunkState.LEAKED and was is ChunkState.FAULTING:  # may be pinned: count it all
            self.registered_bytes += sum(piece.nbytes for piece in self.pieces.get(index, (self.chunks[index],)))
        self._drop_part(index)  # unregistered: nothing of it pinned; leaked: counted above

    def close(self) -> None:
        """Mark teardown done; every chunk still REGISTERED at this point is a driver bug."""
        if self.phase is Phase.PINNING:
            raise LedgerError("close while still pinning")
        left = [i for i, state in enumerate(self.states) if state in _UNDO]
        if left:
            raise LedgerError(f"close with chunks {left} still registered")
        self.phase = Phase.CLOSED

    def disown(self) -> tuple[Chunk, ...]:
        """Close without unregistering (a forked child: the registrations are its parent's)."""
        if self.phase is Phase.PINNING:
            raise LedgerError("disown while still pinning")
        kept = tuple(self.chunks[i] for i, state in enumerate(self.states) if state in _UNDO)
        self.phase = Phase.CLOSED
        return kept

    def leaked(self) -> tuple[Chunk, ...]:
        return tuple(self.chunks[i] for i, state in enumerate(self.states) if state is ChunkState.LEAKED)

    def failures_in(self, *phases: str) -> tuple[ChunkFailure, ...]:
        return tuple(f for f in self.failures if f.phase in phases)


_BY_OFFSET = operator.attrgetter("offset")


class RegistrationBook:
    """What the runtime has registered right now, call by call: ``pool.registrations``. Each write is one
    atomic store (no session lock) and :meth:`snapshot` copies each structure in one."""

    __slots__ = ("_chunks", "_pieces", "_whole")

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        self._chunks = chunks
        self._whole = bytearray(len(chunks))  # 1: chunk i is registered as one call (1 B per chunk)
        self._pieces: dict[int, int] = {}  # offset -> nbytes of registered ranges smaller than their chunk

    def chunk_registered(self, index: int) -> None:
        """Chunk ``index`` was registered whole, in one call."""
        self._whole[index] = 1

    def registered(self, index: int, chunk: Chunk, piece: Chunk) -> None:
        """``piece`` of chunk ``index`` (``chunk`` itself, or part of it) was registered."""
        if piece.offset == chunk.offset and piece.nbytes == chunk.nbytes:
            self._whole[index] = 1
        else:
            self._pieces[piece.offset] = piece.nbytes

    def unregistered(self, index: int, chunk: Chunk, piece: Chunk) -> None:
        """``piece`` of chunk ``index`` (``chunk`` itself, or one of its pieces) was unregistered."""
        if piece is chunk or (piece.offset == chunk.offset and piece.nbytes == chunk.nbytes):
            self._whole[index] = 0
        else:
            self._pieces.pop(piece.offset, None)

    def snapshot(self) -> tuple[Chunk, ...]:
        """Every range registered now, sorted by offset."""
        whole = bytes(self._whole) + b"\0"  # one copy each: a consistent view; the 0 ends the last run
        pieces = self._pieces.copy()
        chunks = self._chunks
        run_of = chunks._make if isinstance(chunks, ChunkTable) else lambda lo, hi: chunks[lo:hi]
        found: list[Chunk] = []
        start = whole.find(1)
        while start != -1:
            end = whole.find(0, start)
            if end - start == 1:
                found.append(chunks[start])
            else:
                found.extend(run_of(start, end))
            start = whole.find(1, end)
        found.extend(Chunk(offset, nbytes) for offset, nbytes in pieces.items())
        found.sort(key=_BY_OFFSET)
        return tuple(found)
