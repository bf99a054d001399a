"""A runtime is untrusted: what one runtime call's answer tells pinpool, and what it does not.

A runtime's contract is to return ``None`` or raise :class:`pinpool.RuntimeCallError`, its typed
"nothing was done" answer. Anything else (a ``RuntimeError`` from a binding, a ``SystemExit`` or
``KeyboardInterrupt`` raised inside the driver wrapper, a return value) says nothing about what
the call did before it went wrong: a register call may have registered and then raised, and a
range booked as failed would then stay pinned after ``close()`` with nothing to say so. Such an
answer is therefore "may be registered": the caller books the range for teardown, which
unregisters it (a "not registered" answer there is fine) or reports it leaked.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import RuntimeCallError, UnexpectedReturn, as_runtime_error

__all__ = ["Answer", "untrusted_call"]

# A runtime's garbage return value goes into an error message and a log line: bounded.
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


@dataclass(frozen=True)
class Answer:
    """One runtime call's answer. ``error``: the call failed (None: it returned None). ``maybe``:
    the failure is not the runtime's typed "nothing was done", so the call may have done its work
    (a register may have registered). ``raised``: what the runtime raised, when that was not an
    ``Exception`` (``SystemExit``, ``KeyboardInterrupt``): recorded so it is raised again where
    someone can handle it, never swallowed on a worker thread."""

    error: RuntimeCallError | None = None
    maybe: bool = False
    raised: BaseException | None = None


_DONE = Answer()


def untrusted_call(call: Callable[[int, int], object], op: str, ptr: int, nbytes: int) -> Answer:
    """Make one runtime call and classify its answer; never raises (a worker thread has no caller)."""
    try:
        returned = call(ptr, nbytes)
    except RuntimeCallError as exc:  # the runtime's own typed failure: it did nothing
        return Answer(exc)
    except Exception as exc:
        return Answer(as_runtime_error(exc, op, ptr, nbytes), maybe=True)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt, GeneratorExit: booked, then raised again
        return Answer(as_runtime_error(exc, op, ptr, nbytes), maybe=True, raised=exc)
    if returned is None:
        return _DONE
    try:
        shown = _REPR.repr(returned)
    except Exception as exc:  # a garbage object whose __repr__ raises too
        shown = f"a {type(returned).__name__} (whose repr raised {type(exc).__name__})"
    return Answer(UnexpectedReturn(op=op, ptr=ptr, nbytes=nbytes, returned=shown), maybe=True)
