"""Host registration through torch's ``cudart`` binding: the logic CUDA and ROCm share.

``torch.cuda.cudart()`` is the same Python binding on both builds: on ROCm torch is
hipified, so ``cudaHostRegister`` there calls ``hipHostRegister`` and returns a
``hipError_t`` (the binding's names are kept as ``cuda*`` on purpose). What differs is the
error table, the library that holds the calls the binding lacks (``cudaGetLastError`` /
``hipGetLastError`` to clear a failure's sticky error, ``...GetErrorName`` to name an
unknown code), and which torch build the runtime may run on. :class:`GpuApi` holds those
differences; :class:`HostRegisterRuntime` is everything else, written once.

The binding, the library and the device setter can be injected (``_from_parts``), so this
logic runs in CI through stubs shaped like the real ones; the public constructors find the
real ones through torch.
"""

from __future__ import annotations

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

    def __init__(self, device: int | str | None = None, flags: int = 0) -> None:
        import torch

        self._require_platform(torch)
        _check_flags(flags, self._api)
        index = torch.cuda.current_device() if device is None else device_index(torch, device, self.name)
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise ConfigError(f"device={device!r} is not one of the {count} visible {self._api.platform} devices")
        self._bind(
            binding=torch.cuda.cudart(),  # type: ignore[no-untyped-call]
            library=load_library(self._api),
            device_context=torch.cuda.device,
            device=int(index),
            flags=flags,
        )

    @classmethod
    def _from_parts(
        cls,
        *,
        binding: CudartBinding,
        library: Any | None,
        device_context: DeviceContext,
        device: int = 0,
        flags: int = 0,
    ) -> Self:
        """A runtime on the given binding, library and device setter, without asking torch for them.

        For tests: stubs with the shape of ``torch.cuda.cudart()``, of the loaded library
        (``<prefix>GetLastError()``, ``<prefix>GetErrorName(code) -> bytes | None``) and of
        ``torch.cuda.device``. The platform checks of the public constructor are skipped.
        """
        _check_flags(flags, cls._api)
        runtime = cls.__new__(cls)
        runtime._bind(binding=binding, library=library, device_context=device_context, device=device, flags=flags)
        return runtime

    def _bind(
        self, *, binding: CudartBinding, library: Any | None, device_context: DeviceContext, device: int, flags: int
    ) -> None:
        self.device = device
        self.flags = flags
        self._binding = binding
        self._device_context = device_context
        self._get_last_error: Callable[[], object] | None = None
        self._get_error_name: Callable[[int], object] | None = None
        if library is not None:
            self._get_last_error = getattr(library, self._api.get_last_error)
            self._get_error_name = getattr(library, self._api.get_error_name, None)
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
