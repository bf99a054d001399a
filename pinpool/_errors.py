"""pinpool's exceptions and warnings: one base class, one subclass per kind of failure.

Every error is also the builtin its callers already catch: bad input is a ``ValueError``, and
every failure of pinning itself (a runtime call, a pin, an unpin, memory already pinned, a
pool in the wrong state) is a ``RuntimeError``, as the reference implementation (SGLang's
chunked ``cudaHostRegister``) raises, so ``except RuntimeError`` code written against it keeps
catching them. Every error pickles (to cross process boundaries) with its attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._plan import Chunk


class PinpoolError(Exception):
    """Base class of every error pinpool raises."""


class ConfigError(PinpoolError, ValueError):
    """Bad input (size, layout, option, environment variable), raised before anything is pinned."""


class PoolStateError(PinpoolError, RuntimeError):
    """A pool was used in a state that does not allow it (re-entered, used after exit, ...)."""


class AlreadyPinnedError(PinpoolError, RuntimeError):
    """The memory to pin overlaps memory that is already pinned; nothing was changed.

    Also a ``RuntimeError``: the reference implementation surfaces the same condition as the
    runtime's "already registered" failure (CUDA error 712), a ``RuntimeError``.
    """


class RuntimeCallError(PinpoolError, RuntimeError):
    """One runtime call (populate, register or unregister of one range) failed.

    Also a ``RuntimeError``, as a failed registration is in the reference implementation.
    ``code`` is the runtime's own number (errno for mlock, ``cudaError_t`` for CUDA),
    ``reason`` its short, bounded name (``ENOMEM``, ``cudaErrorMemoryAllocation``), and
    ``message`` the runtime's text plus what to do about it.
    """

    def __init__(self, *, op: str, code: int, reason: str, message: str, ptr: int, nbytes: int) -> None:
        self.op = op
        self.code = code
        self.reason = reason
        self.message = message
        self.ptr = ptr
        self.nbytes = nbytes
        super().__init__(f"{op}(ptr={ptr:#x}, nbytes={nbytes}) failed: {reason} (code {code}): {message}")

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_runtime_call_error, (self.op, self.code, self.reason, self.message, self.ptr, self.nbytes))


def _rebuild_runtime_call_error(
    op: str, code: int, reason: str, message: str, ptr: int, nbytes: int
) -> RuntimeCallError:
    return RuntimeCallError(op=op, code=code, reason=reason, message=message, ptr=ptr, nbytes=nbytes)


@dataclass(frozen=True)
class ChunkFailure:
    """One chunk's failed runtime call: which chunk, in which phase, and the runtime's error."""

    chunk: Chunk
    phase: str  # "populate" | "register" | "unregister"
    error: RuntimeCallError


def _restore_error(cls: type[BaseException], args: tuple[object, ...]) -> BaseException:
    """Unpickle an error whose ``__init__`` takes more than its message: ``__new__`` sets ``args``,
    and pickle then restores its attributes from ``__dict__``."""
    return cls.__new__(cls, *args)


class PinError(PinpoolError, RuntimeError):
    """Pinning a pool failed; everything that was registered has been rolled back.

    Also a ``RuntimeError``: the reference implementation raises ``RuntimeError`` when a
    registration fails, so ``except RuntimeError`` handlers written against it catch this.

    ``offset``, ``nbytes`` and ``code`` describe the first failed chunk (lowest offset);
    ``failures`` lists every failed chunk; ``leaked`` lists the chunks that rollback could
    not unregister (normally empty: anything here is still pinned). When no runtime call
    failed (no worker thread could be started), ``failures`` is empty, ``phase`` is
    ``"start"`` and ``offset``/``nbytes``/``code`` are None; ``__cause__`` says why.
    """

    def __init__(
        self,
        message: str,
        *,
        failures: tuple[ChunkFailure, ...],
        leaked: tuple[Chunk, ...] = (),
    ) -> None:
        first = min(failures, key=lambda f: f.chunk.offset) if failures else None
        self.offset = None if first is None else first.chunk.offset
        self.nbytes = None if first is None else first.chunk.nbytes
        self.code = None if first is None else first.error.code
        self.reason = None if first is None else first.error.reason
        self.phase = "start" if first is None else first.phase
        self.failures = failures
        self.leaked = leaked
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (_restore_error, (type(self), self.args), self.__dict__)


class UnpinError(PinpoolError, RuntimeError):
    """Unregistering one or more chunks failed at teardown; ``leaked`` may still be pinned.

    Also a ``RuntimeError``, like :class:`PinError`.
    """

    def __init__(self, message: str, *, failures: tuple[ChunkFailure, ...], leaked: tuple[Chunk, ...]) -> None:
        self.failures = failures
        self.leaked = leaked
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (_restore_error, (type(self), self.args), self.__dict__)


class UnclosedPoolWarning(RuntimeWarning):
    """A pool was garbage-collected, or still open at interpreter exit, without being exited."""
