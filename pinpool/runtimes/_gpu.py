"""Host registration through torch's ``cudart`` binding: the logic CUDA and ROCm share.

``torch.cuda.cudart()`` is the same Python binding on both builds: on ROCm torch is
hipified, so ``cudaHostRegister`` there calls ``hipHostRegister`` and returns a
``hipError_t`` (the binding's names are kept as ``cuda*`` on purpose). What differs is the
error table, the library that holds the calls the binding lacks (``cudaGetLastError`` /
``hipGetLastError`` to clear a failure's sticky error, ``...GetErrorName`` to name an
unknown code), and which torch build the runtime may run on. :class:`GpuApi` holds those
differences; :class:`HostRegisterRuntime` is everything else, written once.

The binding and the library can be given (``from_binding``, e.g. with
:class:`pinpool.testing.FakeCudart`), so this logic runs in CI on CPU; the plain constructors
find the real ones through torch.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Self, SupportsInt

from .._errors import ConfigError, RuntimeCallError
from .._types import Capabilities

__all__ = ["CudartBinding", "DeviceContext", "GpuApi", "HostRegisterRuntime"]


@dataclass(frozen=True)
class GpuApi:
    """What differs between CUDA and HIP behind torch's one binding."""

    runtime: str  # the runtime's name, as in runtime="..."
    platform: str  # for messages: "CUDA", "ROCm (HIP)"
    register_op: str  # the C call the binding's cudaHostRegister really makes
    unregister_op: str
    error_prefix: str  # "cudaError": names of unknown codes are f"{prefix}{code}"
    unknown_code: int  # the API's own "unknown error" code and name: a library that answers
    unknown_name: str  # it for a code that is not that one does not know the code
    errors: Mapping[int, tuple[str, str]]  # code -> (name, hint)
    library: str  # file name stem of the shared library, as it appears in /proc/self/maps
    get_last_error: str  # its symbol that returns and clears the calling thread's last error
    get_error_name: str  # its symbol that names a code


class CudartBinding(Protocol):
    """The shape of ``torch.cuda.cudart()`` that pinpool uses (the same on CUDA and ROCm builds)."""

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int, /) -> SupportsInt: ...

    def cudaHostUnregister(self, ptr: int, /) -> SupportsInt: ...

    def cudaGetErrorString(self, error: Any, /) -> str: ...

    @property
    def cudaError(self) -> Callable[[int], Any]: ...


# Makes a device current in the calling thread for the duration of a with block
# (torch.cuda.device).
DeviceContext = Callable[[int], AbstractContextManager[object]]


def load_library(api: GpuApi) -> Any | None:
    """The runtime library torch already loaded, for the calls torch's binding does not offer.

    Found in /proc/self/maps and opened by path, which hands back the very library torch
    uses (the same handle, so the same error state). A torch build that linked the runtime
    statically may still export it from the process. None where neither is found.
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if api.library in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            return _typed(ctypes.CDLL(path), api)
        except OSError:
            continue
    process = ctypes.CDLL(None)
    return _typed(process, api) if hasattr(process, api.get_last_error) else None


def _typed(library: ctypes.CDLL, api: GpuApi) -> ctypes.CDLL:
    """Declare the C types of the two calls once; the functions are cached on the CDLL."""
    getattr(library, api.get_last_error).restype = ctypes.c_int
    if hasattr(library, api.get_error_name):
        get_name = getattr(library, api.get_error_name)
        get_name.restype = ctypes.c_char_p
        get_name.argtypes = [ctypes.c_int]
    return library


def device_index(torch: Any, device: int | str, runtime: str) -> int:
    """A device index from an int or a torch device string ("cuda:1"; ROCm GPUs are "cuda" in torch too)."""
    if isinstance(device, bool) or not isinstance(device, int | str):
        raise ConfigError(f"device={device!r} must be a device index (int) or a string like 'cuda:1'")
    if isinstance(device, int):
        if device < 0:
            raise ConfigError(f"device={device!r} must be a non-negative device index")
        return device
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"device={device!r} is not a device; give an index or 'cuda:N'") from None
    if parsed.type != "cuda":
        raise ConfigError(f"device={device!r} is not a GPU device for runtime={runtime!r}; give an index or 'cuda:N'")
    return int(parsed.index) if parsed.index is not None else int(torch.cuda.current_device())


class HostRegisterRuntime:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's binding, with one API's error table.

    ``device``: the GPU the registration is made on, made current in the calling (worker)
    thread for the duration of each call. ``flags``: the register flags (0 = default,
    1 = portable, 2 = mapped, 8 = read-only; the same values under HIP).

    A failed call leaves a sticky "last error" in the calling thread; it is cleared at once
    (the library's ``...GetLastError``, in that thread), so the next, unrelated GPU call does
    not misreport it. That needs the library's own symbol, found in the library torch loaded
    or in the process; ``clears_sticky_errors`` says whether it was.
    """

    name: str
    capabilities: ClassVar[Capabilities]
    _api: ClassVar[GpuApi]

    device: int
    flags: int
    clears_sticky_errors: bool
    _get_last_error: Callable[[], object] | None
    _get_error_name: Callable[[int], object] | None

    def __init__(self, device: int | str | None = None, flags: int = 0) -> None:
        import torch

        self._require_platform(torch)
        _check_flags(flags, self._api)
        index = torch.cuda.current_device() if device is None else device_index(torch, device, self.name)
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise ConfigError(f"device={device!r} is not one of the {count} visible {self._api.platform} devices")
        library = load_library(self._api)
        getters = (None, None) if library is None else _library_calls(library, self._api)
        self._bind(
            torch.cuda.cudart(),  # type: ignore[no-untyped-call]
            getters,
            device_context=torch.cuda.device,
            device=int(index),
            flags=flags,
        )

    @classmethod
    def from_binding(
        cls, binding: CudartBinding, *, library: Any | None = None, device: int = 0, flags: int = 0
    ) -> Self:
        """This runtime on a binding shaped like ``torch.cuda.cudart()``, without asking torch for it.

        For tests on hosts without a GPU (:class:`pinpool.testing.FakeCudart`) and for a binding
        of your own. ``library``: what holds ``<prefix>GetLastError()`` and
        ``<prefix>GetErrorName(code) -> bytes`` (the loaded libcudart / libamdhip64); None: the
        binding itself where it has ``cudaGetLastError`` (FakeCudart has; torch's binding has
        not, so a failure's sticky error is then not cleared: ``clears_sticky_errors``).
        ``device``: the device index each call is made on, made current with
        ``torch.cuda.device`` where torch sees a GPU, and a no-op without one. The platform
        checks of the plain constructor are skipped; a binding that names its platform (FakeCudart's
        ``platform``) must name this runtime's.
        """
        _check_flags(flags, cls._api)
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ConfigError(f"device={device!r} must be a non-negative device index (int)")
        platform = getattr(binding, "platform", None)
        if platform is not None and platform != cls._api.runtime:
            raise ConfigError(
                f"{cls.__name__}.from_binding: the binding is for platform={platform!r}, whose error codes differ; "
                f"use a binding for platform={cls._api.runtime!r}"
            )
        missing = [name for name in _BINDING_CALLS if not callable(getattr(binding, name, None))]
        if missing:
            raise ConfigError(
                f"{cls.__name__}.from_binding: binding={binding!r} has no callable {', '.join(missing)}; pass "
                "torch.cuda.cudart() or pinpool.testing.FakeCudart()"
            )
        getters: tuple[Callable[[], object] | None, Callable[[int], object] | None] = (None, None)
        if library is not None:
            getters = _library_calls(library, cls._api)
        elif callable(getattr(binding, "cudaGetLastError", None)):  # torch's binding keeps cuda* names on ROCm
            getters = (binding.cudaGetLastError, getattr(binding, "cudaGetErrorName", None))  # type: ignore[attr-defined]
        runtime = cls.__new__(cls)
        runtime._bind(binding, getters, device_context=_device_context(), device=device, flags=flags)
        return runtime

    def _bind(
        self,
        binding: CudartBinding,
        getters: tuple[Callable[[], object] | None, Callable[[int], object] | None],
        *,
        device_context: DeviceContext,
        device: int,
        flags: int,
    ) -> None:
        """``getters``: the library's ``<prefix>GetLastError`` and ``<prefix>GetErrorName``, each or None."""
        self.device = device
        self.flags = flags
        self._binding = binding
        self._device_context = device_context
        self._get_last_error, self._get_error_name = getters
        self.clears_sticky_errors = self._get_last_error is not None

    @classmethod
    def _require_platform(cls, torch: Any) -> None:
        """Raise ConfigError unless this torch build and host can run this runtime."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, flags={self.flags})"

    def register(self, ptr: int, nbytes: int) -> None:
        with self._device_context(self.device):
            rc = int(self._binding.cudaHostRegister(ptr, nbytes, self.flags))
            if rc:
                self._clear_last_error()
        if rc:
            raise self._error(self._api.register_op, rc, ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        with self._device_context(self.device):
            rc = int(self._binding.cudaHostUnregister(ptr))
            if rc:
                self._clear_last_error()
        if rc:
            raise self._error(self._api.unregister_op, rc, ptr, 0)

    def _clear_last_error(self) -> None:
        """Clear the failure's sticky error; called in the thread that made the failed call."""
        if self._get_last_error is not None:
            self._get_last_error()

    def _error(self, op: str, rc: int, ptr: int, nbytes: int) -> RuntimeCallError:
        name, hint = self._api.errors.get(rc, (self._error_name(rc), ""))
        try:
            text = str(self._binding.cudaGetErrorString(self._binding.cudaError(rc)))
        except Exception:  # an enum value the binding does not accept
            text = f"{self._api.platform} error {rc}"
        message = f"{text} (device {self.device})" + (f"; {hint}" if hint else "")
        return RuntimeCallError(op=op, code=rc, reason=name, message=message, ptr=ptr, nbytes=nbytes)

    def _error_name(self, rc: int) -> str:
        """The library's name for a code missing from the table, if it really knows the code.

        CUDA answers "unrecognized error code" and HIP "hipErrorUnknown" for codes they do not
        know; neither is a name for *this* code, so those get ``<prefix><code>``.
        """
        fallback = f"{self._api.error_prefix}{rc}"
        if self._get_error_name is None:
            return fallback
        raw = self._get_error_name(rc)
        name = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        if not isinstance(name, str) or not name.isidentifier() or not name.startswith(self._api.error_prefix):
            return fallback
        if name == self._api.unknown_name and rc != self._api.unknown_code:
            return fallback
        return name


def _check_flags(flags: object, api: GpuApi) -> None:
    if isinstance(flags, bool) or not isinstance(flags, int) or flags < 0:
        raise ConfigError(f"flags={flags!r} must be a non-negative int of {api.register_op} flags")


_BINDING_CALLS = ("cudaHostRegister", "cudaHostUnregister", "cudaGetErrorString")


def _library_calls(library: Any, api: GpuApi) -> tuple[Callable[[], object] | None, Callable[[int], object] | None]:
    """The library's ``<prefix>GetLastError`` and ``<prefix>GetErrorName`` (None where it lacks one)."""
    return getattr(library, api.get_last_error, None), getattr(library, api.get_error_name, None)


def _device_context() -> DeviceContext:
    """``torch.cuda.device`` where torch sees a GPU; otherwise a context that switches nothing."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return contextlib.nullcontext
    if torch.cuda.is_available():
        return torch.cuda.device
    return contextlib.nullcontext
