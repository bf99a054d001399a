"""What a runtime is, the optional abilities it may declare, and how a declaration is checked.

A runtime's abilities are *declared* (its ``capabilities``, a :class:`Capabilities`), never
guessed from which attributes it happens to have: a method inherited from a base class, a
mock's auto-attribute or a wrapper that forwards everything would otherwise switch on a code
path nobody asked for. The declaration is checked once, when the runtime is resolved, so a
runtime that declares an ability it lacks fails at construction with a message, not midway
through pinning a terabyte.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .._errors import ConfigError
from .._types import Capabilities

__all__ = ["Capabilities", "FindsPinned", "LocksOnFault", "Populates", "Runtime", "capabilities_of"]


@runtime_checkable
class Runtime(Protocol):
    """What PinnedPool needs from a runtime. Both calls are made from worker threads.

    ``register(ptr, nbytes)`` pins ``[ptr, ptr+nbytes)``; ``unregister(ptr)`` undoes the
    registration whose base is ``ptr``. Both are thread-safe and raise
    :class:`pinpool.RuntimeCallError` carrying the runtime's own code and message. A runtime
    may also declare ``capabilities`` (a :class:`Capabilities`; none declared means none).
    """

    name: str

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


@runtime_checkable
class Populates(Protocol):
    """``Capabilities.populates``: pre-faults a span itself, instead of MADV_POPULATE_WRITE."""

    def populate(self, ptr: int, nbytes: int) -> None: ...


@runtime_checkable
class LocksOnFault(Protocol):
    """``Capabilities.locks_on_fault``: registers a range before it is faulted, so faulting it also locks it."""

    def lock_on_fault(self, ptr: int, nbytes: int) -> None: ...


@runtime_checkable
class FindsPinned(Protocol):
    """``Capabilities.finds_pinned``: describes memory in a range that is already pinned outside pinpool."""

    def find_pinned(self, ptr: int, nbytes: int) -> str | None: ...


# Each ability, the method it promises and the signature to name in an error.
_ABILITIES: tuple[tuple[str, str, str], ...] = (
    ("populates", "populate", "populate(ptr, nbytes)"),
    ("locks_on_fault", "lock_on_fault", "lock_on_fault(ptr, nbytes)"),
    ("finds_pinned", "find_pinned", "find_pinned(ptr, nbytes) -> str | None"),
)


def capabilities_of(runtime: Runtime) -> Capabilities:
    """The abilities ``runtime`` declares, checked against the methods it has.

    A runtime without a ``capabilities`` attribute (a user's object written against the two
    required calls) gets ``Capabilities()``: nothing optional is used. Raises
    :class:`pinpool.ConfigError` when the declaration is not a ``Capabilities`` or names an
    ability whose method is missing or not callable, since the pool would otherwise fail on
    its first chunk.
    """
    declared = getattr(runtime, "capabilities", None)
    if declared is None:
        return Capabilities()
    name = getattr(runtime, "name", type(runtime).__name__)
    if not isinstance(declared, Capabilities):
        raise ConfigError(
            f"runtime {name!r} ({type(runtime).__qualname__}) declares capabilities={declared!r}, which is not a "
            "pinpool.runtimes.Capabilities; declare Capabilities(...) or leave the attribute out (nothing optional)"
        )
    for flag, method, signature in _ABILITIES:
        if getattr(declared, flag) and not callable(getattr(runtime, method, None)):
            raise ConfigError(
                f"runtime {name!r} ({type(runtime).__qualname__}) declares {flag}=True but has no callable "
                f"{method}; define {signature} or declare {flag}=False"
            )
    return declared
