"""The one registry of runtime names: what ``runtime="..."`` accepts, the CLI offers and the docs list.

Each name maps to a factory, a one-line description and a check of whether it can run on
this host. ``resolve_runtime``, ``RUNTIME_NAMES``, ``runtime_choices()`` and the table in
docs/operations.md all come from here (a test holds the docs to it), so adding a runtime is
one entry, not five edits that drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import ConfigError
from .._types import Capabilities
from ._base import Runtime, capabilities_of
from ._cuda import CudaRuntime
from ._mlock import MlockRuntime
from ._rocm import RocmRuntime

if TYPE_CHECKING:
    from .._host.facts import HostFacts

__all__ = [
    "RUNTIME_NAMES",
    "RuntimeInfo",
    "auto_runtime_name",
    "resolve_runtime",
    "runtime_choices",
    "runtime_info",
    "runtime_infos",
]


@dataclass(frozen=True)
class RuntimeInfo:
    """One registered runtime name.

    ``factory()`` builds the runtime with its defaults (raising :class:`pinpool.ConfigError`
    where it cannot run); ``available()`` says, without building it, whether it can run on
    this host; ``description`` is one line for help texts and docs.
    """

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
    """The runtime ``"auto"`` picks here: ``"rocm"`` on a ROCm build of torch with a GPU, else
    ``"cuda"`` with a GPU, else ``"mlock"``.

    On ROCm, ``torch.cuda.is_available()`` is true as well; only ``torch.version.hip`` tells
    the builds apart, and CUDA's error table would misname HIP's codes.
    """
    return _gpu_build() or "mlock"


def _auto() -> Runtime:
    return _REGISTRY[auto_runtime_name()].factory()


def _always() -> bool:
    return True


_INFOS = (
    RuntimeInfo("auto", "rocm on ROCm builds of torch with a GPU, else cuda with a GPU, else mlock", _auto, _always),
    RuntimeInfo(
        "cuda",
        "cudaHostRegister through torch.cuda.cudart(), on torch's current CUDA device",
        CudaRuntime,
        lambda: _gpu_build() == "cuda",
    ),
    RuntimeInfo(
        "rocm",
        "hipHostRegister through torch's hipified cudart binding, on torch's current ROCm device",
        RocmRuntime,
        lambda: _gpu_build() == "rocm",
    ),
    RuntimeInfo(
        "mlock",
        "Linux mlock: real page-locking for CPU-only hosts, tests and benchmarks; not GPU pinning",
        MlockRuntime,
        _always,
    ),
)
_REGISTRY: dict[str, RuntimeInfo] = {info.name: info for info in _INFOS}

RUNTIME_NAMES: tuple[str, ...] = tuple(_REGISTRY)
"""Every name ``runtime=`` accepts, ``"auto"`` first."""


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
    """A registered name (see :data:`RUNTIME_NAMES`) built with its defaults, or a runtime object as is.

    Either way the runtime's declared capabilities are checked (:func:`capabilities_of`), so
    a runtime that declares an ability it lacks fails here, before anything is mapped.
    """
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
    """The declared capabilities that say what pinning with ``runtime`` costs the host: a runtime
    object's, a :class:`Capabilities` as given, or those of the runtime a registered name
    (``"auto"``, ``"mlock"``, ``"cuda"``, ``"rocm"``) resolves to, read from its class without
    building it. None when there is no runtime to judge: None (not said) or an unknown name
    (resolving it raises the ConfigError).

    ``"auto"`` is judged from the host facts, without starting a GPU driver: mlock unless torch
    was built for CUDA with the NVIDIA driver loaded, or for ROCm with /dev/kfd. A GPU stack with
    no visible device resolves to mlock after all; its memlock shortfall then surfaces as mlock's
    own ENOMEM, in a PinError after a full rollback.
    """
    if runtime is None or isinstance(runtime, Capabilities):
        return runtime
    if isinstance(runtime, str):
        name = runtime
        if name == "auto":
            cuda, rocm = host.torch_cuda and host.nvidia_driver, host.torch_hip and host.amd_kfd
            name = "cuda" if cuda else "rocm" if rocm else "mlock"
        try:
            factory = runtime_info(name).factory
        except ConfigError:
            return None
        return capabilities_of(factory)  # type: ignore[arg-type]  # a runtime class: its declaration
    return capabilities_of(runtime)  # type: ignore[arg-type]  # checked there
