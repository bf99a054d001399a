"""One transfer registrar call, made and classified; never raises (a worker thread has no caller). A register
returns a handle; a typed RuntimeCallError means nothing was done; anything else may have registered."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import RuntimeCallError, UnexpectedReturn, as_runtime_error, class_name, foreign_text


@dataclass(frozen=True)
class TransferAnswer:
    handle: object = None
    error: RuntimeCallError | None = None
    maybe: bool = False  # the call may have registered (or still hold) the range
    raised: BaseException | None = None  # a non-Exception it raised, to raise again where someone can
    seconds: float = 0.0


def call_registrar(call: Callable[[], object], registrar: str, op: str, ptr: int, nbytes: int) -> TransferAnswer:
    """``call()`` (``op``: "register" or "unregister", of registrar ``registrar``), its answer classified.
    Errors name the registrar in their op ("mooncake register"), so a PinError says which engine failed."""
    named = f"{registrar} {op}"
    started = time.perf_counter()
    raised: BaseException | None = None
    returned: object = None
    try:
        returned = call()
    except RuntimeCallError as exc:  # the registrar's own typed failure: it did nothing
        error = RuntimeCallError(
            op=named, code=exc.code, reason=exc.reason, message=exc.message, ptr=ptr, nbytes=nbytes
        )  # fmt: skip
        return TransferAnswer(error=error, seconds=time.perf_counter() - started)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt too: booked, then raised again
        raised = exc
    seconds = time.perf_counter() - started
    if raised is None and (op == "register" or returned is None):
        return TransferAnswer(handle=returned, seconds=seconds)
    again: BaseException | None = None
    try:
        if raised is None:
            error = UnexpectedReturn(op=named, ptr=ptr, nbytes=nbytes, returned=foreign_text(returned, repr, 100))
        else:
            error = as_runtime_error(raised, named, ptr, nbytes)
    except BaseException as exc:  # reading the answer raised (a __str__ that raises)
        again = exc
        error = RuntimeCallError(
            op=named, code=-1, reason=class_name(exc), ptr=ptr, nbytes=nbytes,
            message=f"reading the registrar's answer raised {class_name(exc)}",
        )  # fmt: skip
    if raised is None or isinstance(raised, Exception):
        raised = again
    return TransferAnswer(error=error, maybe=True, raised=raised, seconds=seconds)
