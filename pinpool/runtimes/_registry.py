"""What a runtime is, and the one registry of runtime names (a test holds docs/operations.md's table to
it). Abilities are *declared*, never guessed from attributes (a mock has them all), and checked at
resolution: a false declaration fails at construction, not midway through pinning a terabyte.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .._errors import ConfigError
from .._types import Capabilities
from ._gpu import CUDA, HIP, CudaRuntime, RocmRuntime
from ._mlock import MlockRuntime

if TYPE_CHECKING:
    from .._plan.facts import HostFacts


@runtime_checkable
class Runtime(Protocol):
    """What PinnedPool needs from a runtime: thread-safe ``register(ptr, nbytes)`` and ``unregister(ptr)`` (of
    the registration based at ``ptr``), raising :class:`pinpool.RuntimeCallError`; ``capabilities`` optional."""

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
    """The abilities ``runtime`` declares (none declared: ``Capabilities()``), checked against its
    methods: a false declaration raises :class:`pinpool.ConfigError` here, not on the first chunk."""
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


@dataclass(frozen=True)
class RuntimeInfo:
    """One registered name: ``factory()`` builds it (ConfigError where it cannot run), ``available()``
    says without building it whether it can run here, ``description`` is one line for help and docs."""

    name: str
    description: str
    factory: Callable[[], Runtime]
    available: Callable[[], bool]


def _gpu_build() -> str | None:
    """``"rocm"`` or ``"cuda"`` when torch sees a GPU, by the build of torch; None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return "rocm" if torch.version.hip else "cuda"


def auto_runtime_name() -> str:
    """``"auto"`` here: ``"rocm"`` on a ROCm build with a GPU, else ``"cuda"`` with one, else ``"mlock"``
    (``torch.cuda.is_available()`` is true on ROCm too; only ``torch.version.hip`` tells them apart)."""
    return _gpu_build() or "mlock"


_AUTO_STAND_INS: list[Runtime] = []  # what "auto" is in tests (auto_runtime, the one seam), innermost last


@contextlib.contextmanager
def auto_runtime(runtime: Runtime) -> Iterator[Runtime]:
    """While the block runs, ``runtime="auto"`` (the default) is ``runtime`` in every thread (a test client
    may run a server's lifespan on one of its own); blocks nest. For tests of a server that builds its pool."""
    runtime = resolve_runtime(runtime)  # an object with register/unregister, its declaration checked
    _AUTO_STAND_INS.append(runtime)
    try:
        yield runtime
    finally:
        _AUTO_STAND_INS.remove(runtime)


def _auto() -> Runtime:
    return _AUTO_STAND_INS[-1] if _AUTO_STAND_INS else _REGISTRY[auto_runtime_name()].factory()


_INFOS = (
    RuntimeInfo("auto", "rocm on ROCm builds of torch with a GPU, else cuda with a GPU, else mlock",
                _auto, lambda: True),
    RuntimeInfo("cuda", "cudaHostRegister through torch.cuda.cudart(), on torch's current CUDA device",
                CudaRuntime, lambda: _gpu_build() == "cuda"),
    RuntimeInfo("rocm", "hipHostRegister through torch's hipified cudart binding, on torch's current ROCm device",
                RocmRuntime, lambda: _gpu_build() == "rocm"),
    RuntimeInfo("mlock", "Linux mlock: real page-locking for CPU-only hosts, tests and benchmarks; not GPU pinning",
                MlockRuntime, lambda: True),
)  # fmt: skip
_REGISTRY: dict[str, RuntimeInfo] = {info.name: info for info in _INFOS}

RUNTIME_NAMES: tuple[str, ...] = tuple(_REGISTRY)  # every name runtime= accepts, "auto" first


# The values pinpool_chunk_failures_total{reason} takes (docs/metrics.md); any other reason counts as
# "other", so a binding answering garbage codes adds no series per code (log events keep the reason).
FAILURE_REASONS = frozenset({
    *(name for api in (CUDA, HIP) for name, _hint in api.errors.values()),
    *errno.errorcode.values(),  # mlock's, populate's
    *(name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)),
    "UnexpectedReturn", "InternalError", "Abandoned",  # a garbage return, a crashed unpin worker, a teardown given up
})  # fmt: skip


def runtime_infos() -> tuple[RuntimeInfo, ...]:
    """Every registered runtime, in the order help texts and docs list them (``"auto"`` first)."""
    return _INFOS


def runtime_info(name: str) -> RuntimeInfo:
    """The registered runtime called ``name``; :class:`pinpool.ConfigError` if there is none."""
    info = _REGISTRY.get(name)
    if info is None:
        raise ConfigError(
            f"runtime={name!r} is not a runtime; choose one of {', '.join(map(repr, RUNTIME_NAMES))} "
            "or pass an object with register(ptr, nbytes) and unregister(ptr), such as pinpool.testing.FakeRuntime()"
        )
    return info


def runtime_choices() -> tuple[str, ...]:
    """The names for a command line's ``choices=`` (all of them: one unavailable here says why when used)."""
    return RUNTIME_NAMES


def resolve_runtime(runtime: str | Runtime) -> Runtime:
    """A registered name built with its defaults, or a runtime object as is; either way its declared
    capabilities are checked (:func:`capabilities_of`) before anything is mapped."""
    if isinstance(runtime, str):
        resolved = runtime_info(runtime).factory()
    elif isinstance(runtime, Runtime) and isinstance(getattr(runtime, "name", None), str):
        resolved = runtime
    else:
        raise ConfigError(
            f"runtime={runtime!r} is neither a runtime name ({', '.join(map(repr, RUNTIME_NAMES))}) "
            "nor an object with a str name and register(ptr, nbytes) / unregister(ptr) methods"
        )
    capabilities_of(resolved)
    return resolved


def pinning_capabilities(runtime: object, host: HostFacts) -> Capabilities | None:
    """What pinning with ``runtime`` costs the host, read from a registered name's class without building it
    (``"auto"``: judged from the host facts, starting no GPU driver); None for None or an unknown name."""
    if runtime is None or isinstance(runtime, Capabilities):
        return runtime
    if isinstance(runtime, str):
        name = runtime
        if name == "auto" and _AUTO_STAND_INS:
            return capabilities_of(_AUTO_STAND_INS[-1])
        if name == "auto":
            cuda, rocm = host.torch_cuda and host.nvidia_driver, host.torch_hip and host.amd_kfd
            name = "cuda" if cuda else "rocm" if rocm else "mlock"
        try:
            factory = runtime_info(name).factory
        except ConfigError:
            return None
        return capabilities_of(factory)  # type: ignore[arg-type]  # a runtime class: its declaration
    return capabilities_of(runtime)  # type: ignore[arg-type]  # checked there
