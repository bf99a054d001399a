"""pinpool's exceptions and warnings: one base class, one subclass per kind of failure."""

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


class AlreadyPinnedError(PinpoolError):
    """The memory to pin overlaps memory that is already pinned; nothing was changed."""


class RuntimeCallError(PinpoolError):
    """One runtime call (populate, register or unregister of one range) failed.

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


class PinError(PinpoolError):
    """Pinning a pool failed; everything that was registered has been rolled back.

    ``offset``, ``nbytes`` and ``code`` describe the first failed chunk (lowest offset);
    ``failures`` lists every failed chunk; ``leaked`` lists the chunks that rollback could
    not unregister (normally empty: anything here is still pinned).
    """

    def __init__(
        self,
        message: str,
        *,
        failures: tuple[ChunkFailure, ...],
        leaked: tuple[Chunk, ...] = (),
    ) -> None:
        first = min(failures, key=lambda f: f.chunk.offset)
        self.offset = first.chunk.offset
        self.nbytes = first.chunk.nbytes
        self.code = first.error.code
        self.reason = first.error.reason
        self.phase = first.phase
        self.failures = failures
        self.leaked = leaked
        super().__init__(message)


class UnpinError(PinpoolError):
    """Unregistering one or more chunks failed at teardown; ``leaked`` may still be pinned."""

    def __init__(self, message: str, *, failures: tuple[ChunkFailure, ...], leaked: tuple[Chunk, ...]) -> None:
        self.failures = failures
        self.leaked = leaked
        super().__init__(message)


class UnclosedPoolWarning(RuntimeWarning):
    """A pool was garbage-collected, or still open at interpreter exit, without being exited."""
