"""One transfer registrar call, made and classified as a runtime's is (:func:`.untrusted.untrusted_call`): a
register returns a handle; a typed RuntimeCallError means nothing was done; anything else may have registered."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import RuntimeCallError
from .untrusted import untrusted_call


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
    answer = untrusted_call(lambda _ptr, _nbytes: call(), named, ptr, nbytes, returns=op == "register")
    seconds = time.perf_counter() - started
    error = answer.error
    if error is not None and not answer.maybe:  # the registrar's own typed failure: named as its call
        error = RuntimeCallError(
            op=named, code=error.code, reason=error.reason, message=error.message, ptr=ptr, nbytes=nbytes
        )  # fmt: skip
    return TransferAnswer(answer.returned, error, answer.maybe, answer.raised, seconds)
