"""pinpool's exceptions and warnings: one base class, one subclass per kind of failure. Each is also
the builtin its callers already catch (bad input: ``ValueError``; a failure of pinning itself:
``RuntimeError``, as SGLang's chunked ``cudaHostRegister`` raises), and pickles with its attributes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol


class Chunk(Protocol):
    """A chunk's range in the pool (:class:`pinpool.Chunk` is one): a protocol, as this module imports nothing."""

    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


# The one advice for a shortfall of RLIMIT_MEMLOCK (the pre-flight, pinpool doctor, mlock's errors).
RAISE_MEMLOCK = (
    "raise the limit (`ulimit -l unlimited`; systemd `LimitMEMLOCK=infinity`; docker `--ulimit memlock=-1:-1`; "
    "/etc/security/limits.conf `memlock unlimited`), grant the process CAP_IPC_LOCK"
)


def hugetlb_fix(huge_page_size: int, pages: int | str) -> str:
    """How to reserve hugetlb pages (the pre-flight's and mmap's advice): 1 GiB ones at boot (at run
    time contiguous 1 GiB is rarely free)."""
    if huge_page_size == 1 << 30:
        return (
            f"hugepagesz=1G hugepages={pages} on the kernel command line and reboot; echo {pages} > "
            "/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages works only while memory is unfragmented"
        )
    return f"echo {pages} > /proc/sys/vm/nr_hugepages, or hugepages= on the kernel command line"


class PinpoolError(Exception):
    """Base class of every error pinpool raises."""

    def __reduce__(self) -> tuple[object, ...]:
        # Unpickled without ``__init__`` (it takes more than the message): pickle restores ``__dict__``.
        return (_restore_error, (type(self), self.args), self.__dict__)


class ConfigError(PinpoolError, ValueError):
    """Bad input (size, layout, option, environment variable), raised before anything is pinned."""


class PoolStateError(PinpoolError, RuntimeError):
    """A pool was used in a state that does not allow it (re-entered, used after exit, ...)."""


class RegionInUseError(PoolStateError):
    """Pages of a shared region were not given back to the host: another process maps the region, and a hole
    punched in its file would take them from that process too. They stay in the file; nothing changed."""


class AllocationError(PinpoolError, MemoryError):
    """The operating system refused to map the pool's memory."""


class LedgerError(RuntimeError):
    """A transition the ledger's state does not allow: a pinpool bug, so deliberately no :class:`PinpoolError`."""


class AlreadyPinnedError(PinpoolError, RuntimeError):
    """The memory to pin overlaps memory already pinned (as CUDA's 712 would say); nothing was changed."""


class RuntimeCallError(PinpoolError, RuntimeError):
    """One runtime call (populate, register or unregister of one range) failed. ``code``: the runtime's
    number (errno, ``cudaError_t``); ``reason`` its bounded name; ``message`` its text and what to do."""

    def __init__(self, *, op: str, code: int, reason: str, message: str, ptr: int, nbytes: int) -> None:
        self.op = op
        self.code = code
        self.reason = reason
        self.message = message
        self.ptr = ptr
        self.nbytes = nbytes
        super().__init__(f"{op}(ptr={ptr:#x}, nbytes={nbytes}) failed: {reason} (code {code}): {message}")


class UnexpectedReturn(RuntimeCallError):
    """A runtime call returned ``returned`` (a bounded ``repr``), not ``None``: nothing it did is assumed."""

    def __init__(self, *, op: str, ptr: int, nbytes: int, returned: str) -> None:
        self.returned = returned
        super().__init__(
            op=op, code=-1, reason="UnexpectedReturn", ptr=ptr, nbytes=nbytes,
            message=f"the runtime returned {returned} where None was expected (a runtime's calls return None and "
            "raise pinpool.RuntimeCallError on failure); fix the runtime",
        )  # fmt: skip


TEXT_LIMIT = 400  # characters pinpool keeps of a foreign object's text
_NAME = type.__dict__["__name__"]  # a class's name as type keeps it (a metaclass's __name__ may raise or lie)


def foreign_text(obj: object, show: Callable[[object], object] = str, limit: int = TEXT_LIMIT) -> str:
    """``show(obj)`` of an object pinpool does not own (a runtime's exception, a logger's error): never
    raises an ``Exception``, and keeps at most ``limit`` characters, noting the length of the rest."""
    try:
        text = str.__str__(show(obj))  # an exact str: a subclass's methods are the object's too
    except Exception as exc:
        return f"<{class_name(obj)} whose {getattr(show, '__name__', 'text')} raised {class_name(exc)}>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def class_name(obj: object) -> str:
    """The name of ``obj``'s class, bounded, from the class itself (no code of the object's runs)."""
    return foreign_text(type(obj), _NAME.__get__, limit=100)


def as_runtime_error(exc: BaseException, op: str, ptr: int, nbytes: int, note: str = "") -> RuntimeCallError:
    """A runtime that raised something other than RuntimeCallError still gets a typed record."""
    if isinstance(exc, RuntimeCallError) and not note:
        return exc
    error = RuntimeCallError(
        op=op, code=-1, reason=class_name(exc), message=foreign_text(exc) + note, ptr=ptr, nbytes=nbytes
    )  # fmt: skip
    error.__cause__ = exc
    return error


def between_calls_error(exc: BaseException, op: str, ptr: int, nbytes: int) -> RuntimeCallError:
    """Something pinpool itself raised between a chunk's runtime calls, as that chunk's failure."""
    note = " (raised by pinpool between runtime calls, not by the runtime; this is a pinpool bug, please report it)"
    return as_runtime_error(exc, op, ptr, nbytes, note)


@dataclass(frozen=True)
class ChunkFailure:
    """One chunk's failed runtime call: which chunk, in which phase, and the runtime's error."""

    chunk: Chunk
    phase: str  # "populate" | "register" | "unregister"
    error: RuntimeCallError
    registrar: str | None = None  # a transfer registrar's call (pinpool.registrars), not the runtime's

    @property
    def call(self) -> str:
        """Which call failed, as messages name it: ``"register"``, ``"mooncake register"``."""
        return self.phase if self.registrar is None else f"{self.registrar} {self.phase}"


def _restore_error(cls: type[BaseException], args: tuple[object, ...]) -> BaseException:
    return cls.__new__(cls, *args)


class PinError(PinpoolError, RuntimeError):
    """Pinning a pool failed; everything registered was rolled back (``leaked``: what is still pinned).
    ``offset``, ``nbytes``, ``code``: the first failed chunk's; ``phase`` ``"start"``: no thread could start."""

    def __init__(self, message: str, *, failures: tuple[ChunkFailure, ...], leaked: tuple[Chunk, ...] = ()) -> None:
        first = min(failures, key=lambda f: f.chunk.offset) if failures else None
        self.offset = None if first is None else first.chunk.offset
        self.nbytes = None if first is None else first.chunk.nbytes
        self.code = None if first is None else first.error.code
        self.reason = None if first is None else first.error.reason
        self.phase = "start" if first is None else first.phase
        self.failures = failures
        self.leaked = leaked
        super().__init__(message)


class MemoryGoneError(PinError):
    """Background pinning failed and the pool's memory is gone (another process truncated its shared
    file): no page of the pool may be touched (a touch is SIGBUS), so ``pinned_pages`` is 0."""


class UnpinError(PinpoolError, RuntimeError):
    """Unregistering one or more chunks failed at teardown; ``leaked`` may still be pinned."""

    def __init__(self, message: str, *, failures: tuple[ChunkFailure, ...], leaked: tuple[Chunk, ...]) -> None:
        self.failures = failures
        self.leaked = leaked
        super().__init__(message)


class PressureError(PinpoolError, RuntimeError):
    """Memory pressure could not be read or watched (pinpool._host's pressure reader and PressureWatch): a
    kernel file held what pinpool cannot parse, or no pressure notification can be armed here. ``path``:
    the file; ``value``: what it held, bounded (None where the failure was not about its text)."""

    def __init__(self, message: str, *, path: str, value: str | None = None) -> None:
        self.path = path
        self.value = value
        super().__init__(message)


class UnclosedPoolWarning(RuntimeWarning):
    """A pool was garbage-collected, or still open at interpreter exit, without being exited."""


# -- node pacing (pinpool._node.pacing) -------------------------------------------------------------------

Kind = Literal["slots", "budget"]


class NodeHolderLike(Protocol):
    """A holder (``pinpool._node.pacing.NodeHolder``) by shape: this module imports nothing of pinpool's."""

    @property
    def pid(self) -> int | None: ...
    def describe(self) -> str: ...


class NodeBusyError(PinpoolError, RuntimeError):
    """``node_wait=False`` and every slot is taken, or the request does not fit the node's byte budget
    now; nothing is held. ``limit``, ``in_use``: slots or bytes; ``holders``: who holds them."""

    def __init__(self, message: str, *, directory: str, kind: Kind, limit: int, in_use: int,
                 requested: int | None = None, holders: tuple[NodeHolderLike, ...] = ()) -> None:  # fmt: skip
        self.directory = directory
        self.kind = kind
        self.limit = limit
        self.in_use = in_use
        self.requested = requested
        self.holders = holders
        super().__init__(message)


class NodeWaitCancelled(PinpoolError):
    """A synchronous admission wait was given up (its ``cancelled()`` returned True); nothing is held."""
