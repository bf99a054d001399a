"""One pool's node pacing, as its lifecycle runs it: the admission wait and the holds it gets.

A pool holds a pinning slot while it pins and a share of the node's byte budget while anything
of it is pinned. The wait is a thread step (``_pin/steps.py``), so every driver's interrupt rules
apply to it. The pacing itself (files, locks, the budget's arithmetic) is ``_node/pacing.py``'s; this
module only says when a pool takes its holds, when it lets go of them, and what a failed wait
raises.
"""

from __future__ import annotations

import threading
from collections.abc import Generator

from .._errors import NodeBusyError
from .._node.pacing import BudgetHold, NodeAdmission, SlotHold
from .._observe import Observer
from .outcome import admission_thread_error
from .steps import Ran, RunThreads

# Budget shares of pools whose chunks leaked: never released while this process lives.
_KEPT_HOLDS: list[BudgetHold] = []


class PoolAdmission:
    """The node pacing of one pool (``admission`` None: none, every call is a no-op)."""

    def __init__(
        self, admission: NodeAdmission | None, *, name: str, nbytes: int, describe: str, observer: Observer
    ) -> None:
        self.admission = admission
        self.name = name
        self.nbytes = nbytes
        self.describe = describe
        self.observer = observer
        self.cancel = threading.Event()  # set: give up the wait (exit, collection, interpreter exit)
        self.slot: SlotHold | None = None
        self.budget: BudgetHold | None = None

    def admit(self) -> Generator[RunThreads, Ran, None]:
        """Wait for this host's pacing to admit the pool: a share of the node budget, then a
        pinning slot. A wait that fails lets go of whatever it got, and raises."""
        admission = self.admission
        if admission is None:
            return
        cancel = self.cancel

        def admit() -> None:
            if admission.pacing.budget_bytes is not None:
                self.budget = admission.reserve_budget_sync(self.nbytes, cancelled=cancel.is_set)
            self.slot = admission.acquire_slot_sync(cancelled=cancel.is_set)

        ran = yield RunThreads(
            bodies=(admit,), name=f"pinpool-{self.name}-admit", interruptible=True, on_interrupt=cancel.set
        )
        if not (ran.interrupts or ran.crashed or ran.start_errors):
            for kind, hold in (("budget", self.budget), ("slot", self.slot)):
                if hold is not None and not hold.released:
                    self.observer.node_admitted(kind=kind, seconds=hold.waited_seconds)
            return
        self.release_slot()
        self.release_budget()
        if ran.interrupts:
            raise ran.interrupts[0]
        if ran.crashed:
            error = ran.crashed[0]
            if isinstance(error, NodeBusyError):
                self.observer.node_busy(kind=error.kind)
            raise error
        raise admission_thread_error(self.describe, ran.start_errors[0])

    def release_slot(self) -> None:
        """Pinning is over (or never began): another rank may start pinning."""
        slot, self.slot = self.slot, None
        if slot is not None:
            slot.release()

    def release_budget(self) -> None:
        """Nothing of the pool is pinned any more."""
        budget, self.budget = self.budget, None
        if budget is not None:
            budget.release()

    def keep_budget(self) -> None:
        """Chunks leaked (their unregister failed): those bytes may still be pinned, so the pool's
        budget share stays counted while this process lives."""
        budget, self.budget = self.budget, None
        if budget is not None:
            _KEPT_HOLDS.append(budget)
