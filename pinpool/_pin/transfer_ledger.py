"""The books of the transfer registrars: which registration of which registrar is pending, in flight,
registered or undone. Pure, called under the session's lock like the ledger: a registration is handed out
once every chunk it spans is pinned, a page is usable once every registrar holds it, and teardown undoes
every registrar's registrations (reverse offset order) before the runtime unpins a chunk."""

from __future__ import annotations

import collections
import enum
from collections.abc import Sequence

from .._errors import ChunkFailure, LedgerError, RuntimeCallError
from .._plan.chunks import Chunk
from .._plan.prefix import PrefixTracker
from .._plan.transfers import TransferPlan

Item = tuple[int, int]  # (registrar index, registration index)


class RunState(enum.Enum):
    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    REGISTERED = "registered"
    FAILED = "failed"  # its register call said nothing was registered: nothing to undo
    MAYBE = "maybe"  # its register call failed untrusted: undone at teardown, never usable
    UNREGISTERED = "unregistered"
    LEAKED = "leaked"  # unregistering it failed: the engine may still hold it


_UNDO = frozenset({RunState.REGISTERED, RunState.MAYBE})


class TransferLedger:
    """Every registrar's registrations of one pool, through pinning, rollback and teardown."""

    def __init__(self, plans: Sequence[TransferPlan], prefix: PrefixTracker | None = None) -> None:
        self.plans = tuple(plans)
        self.states = [[RunState.PENDING] * len(plan.registrations) for plan in self.plans]
        self.handles: list[list[object]] = [[None] * len(plan.registrations) for plan in self.plans]
        self._pinned = [[0] * len(plan.registrations) for plan in self.plans]  # bytes of each run pinned
        self._ready: collections.deque[Item] = collections.deque()
        self._out = [0] * len(self.plans)  # register calls in flight, by registrar
        self.in_flight = 0
        self.undoing = [0] * len(self.plans)  # undo calls out with workers, by registrar: chunks wait for none left
        self.left = sum(len(plan.registrations) for plan in self.plans)  # not yet registered
        self.prefix = prefix  # pages usable: covered where every registrar holds the bytes
        self.closed = False

    @property
    def complete(self) -> bool:
        return self.left == 0

    def run(self, item: Item) -> Chunk:
        return self.plans[item[0]].registrations[item[1]]

    def run_bytes(self, item: Item) -> int:
        return self.run(item).nbytes

    def chunk_pinned(self, chunk: Chunk) -> None:
        """Every page of ``chunk`` is pinned: a registration whose chunks all are may be handed out."""
        for j, plan in enumerate(self.plans):
            r = plan.index_of(chunk.offset)
            self._pinned[j][r] += chunk.nbytes
            if self._pinned[j][r] == plan.registrations[r].nbytes:
                self._ready.append((j, r))

    def claim(self) -> Item | None:
        """A registration to make now (its chunks pinned; a serial registrar's previous call returned)."""
        for k, (j, r) in enumerate(self._ready):
            if self.plans[j].limits.parallel or not self._out[j]:
                del self._ready[k]
                self._move((j, r), RunState.PENDING, RunState.IN_FLIGHT)
                self._out[j] += 1
                self.in_flight += 1
                return j, r
        return None

    def _move(self, item: Item, was: RunState | frozenset[RunState], to: RunState) -> RunState:
        j, r = item
        state = self.states[j][r]
        if state is not was and not (isinstance(was, frozenset) and state in was):
            raise LedgerError(f"registration {r} of {self.plans[j].name!r} moved to {to.value} but was {state.value}")
        self.states[j][r] = to
        return state

    def _landed(self, item: Item, to: RunState) -> None:
        self._move(item, RunState.IN_FLIGHT, to)
        self._out[item[0]] -= 1
        self.in_flight -= 1

    def registered(self, item: Item, handle: object) -> None:
        """A register call returned ``handle``; the bytes every registrar now holds become usable pages."""
        # The handle first: a reader without the lock (Transfers.held) that sees REGISTERED finds its handle.
        self.handles[item[0]][item[1]] = handle
        self._landed(item, RunState.REGISTERED)
        self.left -= 1
        if self.prefix is not None:
            for start, end in self._held_by_all(item):
                self.prefix.cover(start, end)

    def _held_by_all(self, item: Item) -> list[tuple[int, int]]:
        run = self.run(item)
        spans = [(run.offset, run.end)]
        for k, plan in enumerate(self.plans):
            if k == item[0]:
                continue
            held: list[tuple[int, int]] = []
            for start, end in spans:
                r = max(0, plan.index_of(start))
                registrations = plan.registrations
                while r < len(registrations) and registrations[r].offset < end:
                    if self.states[k][r] is RunState.REGISTERED:
                        lo, hi = max(start, registrations[r].offset), min(end, registrations[r].end)
                        if lo < hi:
                            held.append((lo, hi))
                    r += 1
            spans = held
        return spans

    def failed(self, item: Item, error: RuntimeCallError, *, maybe: bool) -> ChunkFailure:
        """A register call failed (``maybe``: it may have registered: undone at teardown); the failure to book."""
        self._landed(item, RunState.MAYBE if maybe else RunState.FAILED)
        return ChunkFailure(self.run(item), "register", error, self.plans[item[0]].name)

    def unclaim(self, item: Item) -> None:
        """A claimed registration whose call was never made (pinning stopped first): ready again."""
        self._landed(item, RunState.PENDING)
        self._ready.appendleft(item)

    def abort(self) -> None:
        """Pinning ended with calls in flight though every thread is done (a pinpool bug): maybe registered."""
        for j, states in enumerate(self.states):
            for r, state in enumerate(states):
                if state is RunState.IN_FLIGHT:
                    states[r] = RunState.MAYBE
                    self._out[j] -= 1
        self.in_flight = 0

    def teardown_order(self) -> list[Item]:
        """Registrations to undo, every registrar's, in reverse offset order; empty once closed."""
        if self.closed:
            return []
        found = [(j, r) for j, states in enumerate(self.states) for r, state in enumerate(states) if state in _UNDO]
        found.sort(key=lambda item: (self.run(item).offset, item[0]), reverse=True)
        return found

    @property
    def unpinning(self) -> bool:
        return any(self.undoing)

    def may_undo(self, item: Item, taken: frozenset[int] = frozenset()) -> bool:
        """Whether ``item`` may be handed to a worker taking ``taken`` registrars' undos already (a serial
        registrar's undos go to one worker at a time)."""
        j = item[0]
        return self.plans[j].limits.parallel or not self.undoing[j] or j in taken

    def unregistered(self, item: Item) -> None:
        """Its unregister call returned (or said nothing was registered there)."""
        self._move(item, _UNDO, RunState.UNREGISTERED)

    def unregister_failed(self, item: Item, error: RuntimeCallError) -> ChunkFailure:
        """Its unregister failed, or teardown gave up on it: the engine may still hold it; the failure to book."""
        self._move(item, _UNDO, RunState.LEAKED)
        return ChunkFailure(self.run(item), "unregister", error, self.plans[item[0]].name)

    def close(self) -> None:
        left = self.teardown_order()
        if left:
            raise LedgerError(f"close with transfer registrations {left} still registered")
        self.closed = True

    def disown(self) -> None:
        """A forked child: the registrations are its parent's."""
        self.closed = True

    def leaked(self) -> tuple[Chunk, ...]:
        return tuple(
            self.run((j, r))
            for j, states in enumerate(self.states)
            for r, s in enumerate(states)
            if s is RunState.LEAKED
        )

    def live(self, j: int) -> list[tuple[Chunk, object]]:
        """Registrar ``j``'s registrations held now, with their handles, sorted by offset."""
        registrations, handles = self.plans[j].registrations, self.handles[j]
        return [(registrations[r], handles[r]) for r, s in enumerate(self.states[j]) if s is RunState.REGISTERED]
