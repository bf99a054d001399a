"""Host registration through torch's ``cudart`` binding: CudaRuntime and RocmRuntime, written once
(on ROCm the hipified binding calls HIP; what differs is a :class:`GpuApi`). ``from_binding`` takes
:class:`pinpool.testing.FakeCudart`, so this runs in CI on CPU. Also: the driver facts of ``pinpool doctor``."""

from __future__ import annotations

import contextlib
import ctypes
import re
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Self, SupportsInt

from .._errors import ConfigError, RuntimeCallError, foreign_text
from .._types import Capabilities


@dataclass(frozen=True)
class GpuApi:
    """What differs between CUDA and HIP behind torch's one binding."""

    runtime: str  # the runtime's name, as in runtime="..."
    platform: str  # for messages: "CUDA", "ROCm"
    register_op: str  # the C call the binding's cudaHostRegister really makes
    unregister_op: str
    error_prefix: str  # "cudaError": names of unknown codes are f"{prefix}{code}"
    unknown_code: int  # the API's own "unknown error" code and name: a library that answers
    unknown_name: str  # it for a code that is not that one does not know the code
    errors: Mapping[int, tuple[str, str]]  # code -> (name, hint)
    library: str  # file name stem of the shared library, as it appears in /proc/self/maps
    get_last_error: str  # its symbol that returns and clears the calling thread's last error
    get_error_name: str  # its symbol that names a code
    wrong_build: str  # the error for the other build of torch: .format(version=, build=)


class CudartBinding(Protocol):
    """The shape of ``torch.cuda.cudart()`` that pinpool uses (the same on CUDA and ROCm builds)."""

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int, /) -> SupportsInt: ...
    def cudaHostUnregister(self, ptr: int, /) -> SupportsInt: ...
    def cudaGetErrorString(self, error: Any, /) -> str: ...
    @property
    def cudaError(self) -> Callable[[int], Any]: ...


DeviceContext = Callable[[int], AbstractContextManager[object]]  # torch.cuda.device
Getters = tuple[Callable[[], object] | None, Callable[[int], object] | None]  # <prefix>GetLastError, GetErrorName


def load_library(api: GpuApi) -> Any | None:
    """The runtime library torch loaded, for the calls its binding lacks: by its path in /proc/self/maps
    (the same handle and error state), else the process's own exports (a static link), else None."""
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
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's binding, with one API's error table; a failed
    call's sticky error is cleared in its thread. ``flags``: 0 = default, 1 = portable, 2 = mapped, 8 = read-only."""

    name: str
    capabilities: ClassVar[Capabilities]
    _api: ClassVar[GpuApi]

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
        binding = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        self._bind(binding, getters, device_context=torch.cuda.device, device=int(index), flags=flags)

    @classmethod
    def from_binding(
        cls, binding: CudartBinding, *, library: Any | None = None, device: int = 0, flags: int = 0
    ) -> Self:
        """This runtime on a binding shaped like ``torch.cuda.cudart()``, without the platform checks.
        ``library``: what holds ``<prefix>GetLastError`` and ``GetErrorName``; None: the binding, if it has them."""
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
        getters: Getters = (None, None)
        if library is not None:
            getters = _library_calls(library, cls._api)
        elif callable(getattr(binding, "cudaGetLastError", None)):  # torch's binding keeps cuda* names on ROCm
            getters = (binding.cudaGetLastError, getattr(binding, "cudaGetErrorName", None))  # type: ignore[attr-defined]
        import torch

        context: DeviceContext = torch.cuda.device if torch.cuda.is_available() else contextlib.nullcontext
        runtime = cls.__new__(cls)
        runtime._bind(binding, getters, device_context=context, device=device, flags=flags)
        return runtime

    def _bind(
        self, binding: CudartBinding, getters: Getters, *, device_context: DeviceContext, device: int, flags: int
    ) -> None:
        self.device = device
        self.flags = flags
        self._binding = binding
        self._device_context = device_context
        self._get_last_error: Callable[[], object] | None = getters[0]
        self._get_error_name: Callable[[int], object] | None = getters[1]
        self.clears_sticky_errors = self._get_last_error is not None

    @classmethod
    def _require_platform(cls, torch: Any) -> None:
        hip = torch.version.hip
        build = f"HIP {hip}" if hip else f"CUDA build {torch.version.cuda}"
        if bool(hip) != (cls._api.runtime == "rocm"):
            raise ConfigError(cls._api.wrong_build.format(version=torch.__version__, build=build))
        if not torch.cuda.is_available():
            raise ConfigError(
                f"runtime={cls.name!r} needs a {cls._api.platform} device, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, {build}); use runtime='mlock' on CPU hosts"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, flags={self.flags})"

    def register(self, ptr: int, nbytes: int) -> None:
        self._call(self._api.register_op, lambda: self._binding.cudaHostRegister(ptr, nbytes, self.flags), ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        self._call(self._api.unregister_op, lambda: self._binding.cudaHostUnregister(ptr), ptr, 0)

    def _call(self, op: str, call: Callable[[], SupportsInt], ptr: int, nbytes: int) -> None:
        with self._device_context(self.device):
            rc = int(call())
            if rc and self._get_last_error is not None:
                self._get_last_error()  # in the thread that made the failed call
        if rc:
            raise self._error(op, rc, ptr, nbytes)

    def _error(self, op: str, rc: int, ptr: int, nbytes: int) -> RuntimeCallError:
        name, hint = self._api.errors.get(rc, (self._error_name(rc), ""))
        try:
            text = foreign_text(self._binding.cudaGetErrorString(self._binding.cudaError(rc)))
        except Exception:  # an enum value the binding does not accept
            text = f"{self._api.platform} error {rc}"
        message = f"{text} (device {self.device})" + (f"; {hint}" if hint else "")
        return RuntimeCallError(op=op, code=rc, reason=name, message=message, ptr=ptr, nbytes=nbytes)

    def _error_name(self, rc: int) -> str:
        """The library's name for a code missing from the table, if it really knows it (CUDA answers
        "unrecognized error code" and HIP "hipErrorUnknown" for codes they do not: ``<prefix><code>``)."""
        fallback = f"{self._api.error_prefix}{rc}"
        if self._get_error_name is None:
            return fallback
        raw = self._get_error_name(rc)
        name = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        if not isinstance(name, str) or not name.isidentifier() or not name.startswith(self._api.error_prefix):
            return fallback
        if len(name) > 100 or (name == self._api.unknown_name and rc != self._api.unknown_code):
            return fallback
        return name


def _check_flags(flags: object, api: GpuApi) -> None:
    if isinstance(flags, bool) or not isinstance(flags, int) or flags < 0:
        raise ConfigError(f"flags={flags!r} must be a non-negative int of {api.register_op} flags")


_BINDING_CALLS = ("cudaHostRegister", "cudaHostUnregister", "cudaGetErrorString")


def _library_calls(library: Any, api: GpuApi) -> Getters:
    return getattr(library, api.get_last_error, None), getattr(library, api.get_error_name, None)


# cudaError_t values worth a name and a hint; others: cudaGetErrorName, else "cudaError<code>".
CUDA = GpuApi(
    runtime="cuda", platform="CUDA", register_op="cudaHostRegister", unregister_op="cudaHostUnregister",
    error_prefix="cudaError", unknown_code=999, unknown_name="cudaErrorUnknown",
    library="libcudart", get_last_error="cudaGetLastError", get_error_name="cudaGetErrorName",
    wrong_build="runtime='cuda' runs on NVIDIA CUDA builds of torch, but this is a ROCm build (torch {version}, "
    "{build}), whose registration calls report HIP's codes; use runtime='rocm' (or 'auto')",
    errors={
        1: ("cudaErrorInvalidValue", "check that the range is valid host memory"),
        2: ("cudaErrorMemoryAllocation",
            "the driver could not pin this chunk: lower chunk_bytes= / PINPOOL_REGISTER_CHUNK_GB "
            "(single registrations of 512 GiB or more fail on recent drivers), make the pool smaller, "
            "or check RLIMIT_MEMLOCK"),
        3: ("cudaErrorInitializationError", "the CUDA driver failed to initialise"),
        100: ("cudaErrorNoDevice", "no CUDA device is visible (CUDA_VISIBLE_DEVICES?)"),
        101: ("cudaErrorInvalidDevice", "the device index does not exist"),
        712: ("cudaErrorHostMemoryAlreadyRegistered", "this range, or part of it, is already registered"),
        713: ("cudaErrorHostMemoryNotRegistered", "this pointer is not the base of a registration"),
        801: ("cudaErrorNotSupported", "host registration is not supported here (e.g. some virtualised GPUs)"),
        999: ("cudaErrorUnknown", "an unknown CUDA error"),
    },
)  # fmt: skip

# HIP numbers the common codes as CUDA does, but not the host-registration ones (1061/1062).
HIP = GpuApi(
    runtime="rocm", platform="ROCm", register_op="hipHostRegister", unregister_op="hipHostUnregister",
    error_prefix="hipError", unknown_code=999, unknown_name="hipErrorUnknown",
    library="libamdhip64", get_last_error="hipGetLastError", get_error_name="hipGetErrorName",
    wrong_build="runtime='rocm' needs a ROCm build of torch, but this is torch {version} ({build}); use "
    "runtime='cuda' on NVIDIA GPUs or runtime='mlock' on CPU hosts",
    errors={
        1: ("hipErrorInvalidValue", "check that the range is valid host memory"),
        2: ("hipErrorOutOfMemory",
            "the driver could not pin this chunk: lower chunk_bytes= / PINPOOL_REGISTER_CHUNK_GB, "
            "make the pool smaller, or check RLIMIT_MEMLOCK"),
        3: ("hipErrorNotInitialized", "the HIP runtime failed to initialise"),
        100: ("hipErrorNoDevice", "no ROCm device is visible (HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES?)"),
        101: ("hipErrorInvalidDevice", "the device index does not exist"),
        801: ("hipErrorNotSupported", "host registration is not supported here"),
        999: ("hipErrorUnknown", "an unknown HIP error"),
        1061: ("hipErrorHostMemoryAlreadyRegistered", "this range, or part of it, is already registered"),
        1062: ("hipErrorHostMemoryNotRegistered", "this pointer is not the base of a registration"),
    },
)  # fmt: skip


class CudaRuntime(HostRegisterRuntime):
    """``cudaHostRegister``/``cudaHostUnregister`` through ``torch.cuda.cudart()`` on NVIDIA builds of torch
    (``device``: default torch's current). Codes 1 and 2 are retried smaller (docs/concepts.md); 713 on
    unregister: released by someone else; a stale code is checked by unregistering."""

    name = "cuda"
    capabilities = Capabilities(serial_registration=True, exact_ranges=True, retryable_codes=frozenset({1, 2}),
                                not_registered_codes=frozenset({713}), already_registered_codes=frozenset({712}),
                                stale_codes=True, resident=True)  # fmt: skip
    _api = CUDA


class RocmRuntime(HostRegisterRuntime):
    """``hipHostRegister``/``hipHostUnregister`` through torch's hipified ``torch.cuda.cudart()``. Adjacent
    registrations do **not** get adjacent device aliases; neighbours never share a page (unverified for HIP)."""

    name = "rocm"
    capabilities = Capabilities(serial_registration=True, retryable_codes=frozenset({1, 2}),
                                not_registered_codes=frozenset({1062}), already_registered_codes=frozenset({1061}),
                                stale_codes=True, resident=True)  # fmt: skip
    _api = HIP


# -- the CUDA driver's own facts (pinpool doctor) ---------------------------------------------------

CAN_USE_HOST_POINTER_ATTR = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem, the same in the driver API


@dataclass(frozen=True)
class CudaDevice:
    index: int
    name: str
    can_use_host_pointer: int | None  # the attribute's value; None when it could not be read


@dataclass(frozen=True)
class CudaFacts:
    """What torch and the driver say. ``skip_reason`` set: nothing was probed (no torch, no GPU)."""

    skip_reason: str | None = None
    error: str | None = None  # torch sees a GPU but asking about it failed
    build: str = "cuda"  # "cuda" or "rocm"
    torch_version: str | None = None
    torch_cuda: str | None = None  # torch.version.cuda (or .hip)
    driver_version: str | None = None  # the kernel module's (/proc/driver/nvidia/version)
    driver_cuda: str | None = None  # the CUDA version the driver supports (cuDriverGetVersion)
    devices: tuple[CudaDevice, ...] = ()


def _nvidia_driver_version() -> str | None:
    """The NVIDIA kernel module's version (/proc/driver/nvidia/version); None without one."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        text = ""
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else None


def _libcuda_facts(count: int) -> tuple[str | None, list[int | None]]:
    """libcuda.so.1's supported CUDA version and each device's CanUseHostPointerForRegisteredMem (None: unread)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, [None] * count
    if lib.cuInit(0) != 0:
        return None, [None] * count
    version, device, value = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    cuda = None
    if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
        cuda = f"{version.value // 1000}.{version.value % 1000 // 10}"
    can_use: list[int | None] = []
    for index in range(count):
        ok = lib.cuDeviceGet(ctypes.byref(device), index) == 0
        ok = ok and lib.cuDeviceGetAttribute(ctypes.byref(value), CAN_USE_HOST_POINTER_ATTR, device) == 0
        can_use.append(value.value if ok else None)
    return cuda, can_use


def read_cuda_facts() -> CudaFacts:
    """What ``pinpool doctor`` reports of the GPUs: asked of torch and the driver, when torch sees one."""
    try:
        import torch
    except ImportError:
        return CudaFacts(skip_reason="torch is not importable")
    hip = getattr(torch.version, "hip", None)
    built = hip or getattr(torch.version, "cuda", None)
    if not torch.cuda.is_available():
        build = f"HIP {hip}" if hip else f"CUDA {built}" if built else "CPU only"
        return CudaFacts(skip_reason=f"torch {torch.__version__} sees no GPU (build: {build})")
    try:
        count = torch.cuda.device_count()
        driver_cuda, can_use = (None, [None] * count) if hip else _libcuda_facts(count)
        devices = tuple(CudaDevice(i, torch.cuda.get_device_name(i), can_use[i]) for i in range(count))
        return CudaFacts(
            build="rocm" if hip else "cuda", torch_version=torch.__version__, torch_cuda=str(built),
            driver_version=_nvidia_driver_version(), driver_cuda=driver_cuda, devices=devices,
        )  # fmt: skip
    except Exception as exc:  # a broken driver is a finding, not a crash of the doctor
        return CudaFacts(error=f"{type(exc).__name__}: {exc}")
