"""A runtime's answers, untrusted: one call made and classified, never raising (worker threads have no caller)."""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import RuntimeCallError, UnexpectedReturn, as_runtime_error, class_name, foreign_text

# A runtime returns None or raises RuntimeCallError ("nothing was done"). Anything else says nothing of
# what the call did: a register may have registered, so it is "maybe", booked for teardown.
_REPR = reprlib.Repr()  # a garbage return value, shown in a message and a log line: bounded
_REPR.maxstring = _REPR.maxother = 80


@dataclass(frozen=True)
class Op:
    """One kind of runtime call, for the one call wrapper (:meth:`~pinpool._pin.engine.PinSession._call`)."""

    name: str  # "register", "populate", "unregister": the op its RuntimeCallError names
    call: Callable[[int, int], object]  # (ptr, nbytes); anything but None is the runtime's fault
    took: Callable[[float], None] = lambda _seconds: None  # every call's time, failed or not
    before: Callable[[], None] = lambda: None  # a pin worker's rest under a small CPU quota (_plan/calls.py)


@dataclass(frozen=True)
class Answer:
    """One runtime call's answer: ``error`` (None: it returned None); ``maybe``: the call may have done
    its work; ``raised``: a non-``Exception`` it raised, to raise again where someone can handle it."""

    error: RuntimeCallError | None = None
    maybe: bool = False
    raised: BaseException | None = None
    returned: object = None  # what a call that returns a value (a transfer registrar's register) returned


_DONE = Answer()


def untrusted_call(
    call: Callable[[int, int], object], op: str, ptr: int, nbytes: int, *, returns: bool = False
) -> Answer:
    """Make one runtime call and classify its answer; never raises (a worker thread has no caller).
    ``returns``: the call returns a value (kept in ``returned``), not None."""
    raised: BaseException | None = None
    try:
        returned = call(ptr, nbytes)
    except RuntimeCallError as exc:  # the runtime's own typed failure: it did nothing
        return Answer(exc)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt, GeneratorExit: booked, then raised again
        raised = exc
    else:
        if returns:
            return Answer(returned=returned)
        if returned is None:
            return _DONE
    again: BaseException | None = None
    try:
        if raised is None:
            error: RuntimeCallError = UnexpectedReturn(
                op=op, ptr=ptr, nbytes=nbytes, returned=foreign_text(returned, _REPR.repr, limit=100)
            )
        else:
            error = as_runtime_error(raised, op, ptr, nbytes)
    except BaseException as exc:  # reading the answer raised what is no Exception (from a __str__)
        again = exc
        error = RuntimeCallError(
            op=op, code=-1, reason=class_name(exc), ptr=ptr, nbytes=nbytes,
            message=f"reading the runtime's answer raised {class_name(exc)}",
        )  # fmt: skip
    if raised is None or isinstance(raised, Exception):
        raised = again
    return Answer(error, maybe=True, raised=raised)
