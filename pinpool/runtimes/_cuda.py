"""CudaRuntime: ``cudaHostRegister`` through ``torch.cuda.cudart()`` on NVIDIA CUDA builds of torch."""

from __future__ import annotations

from typing import Any

from .._errors import ConfigError
from .._types import Capabilities
from ._gpu import GpuApi, HostRegisterRuntime

__all__ = ["CUDA", "CudaRuntime"]

# cudaError_t values worth a name and a hint; everything else gets cudaGetErrorName when
# libcudart can be found, else "cudaError<code>".
_CUDA_ERRORS: dict[int, tuple[str, str]] = {
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
}  # fmt: skip

CUDA = GpuApi(
    runtime="cuda",
    platform="CUDA",
    register_op="cudaHostRegister",
    unregister_op="cudaHostUnregister",
    error_prefix="cudaError",
    unknown_code=999,
    unknown_name="cudaErrorUnknown",
    errors=_CUDA_ERRORS,
    library="libcudart",
    get_last_error="cudaGetLastError",
    get_error_name="cudaGetErrorName",
)


class CudaRuntime(HostRegisterRuntime):
    """``cudaHostRegister``/``cudaHostUnregister`` through ``torch.cuda.cudart()``.

    ``device``: the CUDA device the registration is made on (default: torch's current device),
    set in each worker thread for the duration of each call. ``flags``: cudaHostRegister flags
    (0 = default, 1 = portable, 2 = mapped, 8 = read-only).
    A failed registration leaves a sticky "last error"; it is cleared (cudaGetLastError) so the
    next, unrelated CUDA call does not misreport it. That needs libcudart's own symbol, found in
    the libcudart torch loaded or in the process; ``clears_sticky_errors`` says whether it was.

    Capabilities: the driver serialises registration (one register worker is enough), tracks
    registrations by exact byte range (neighbours may share an OS page), and
    ``cudaErrorInvalidValue`` (1) and ``cudaErrorMemoryAllocation`` (2) are worth retrying with
    a smaller chunk: drivers answer a registration that is too large with either (SGLang saw 1 in
    production, for a 32 GiB call whose 4 KiB probe at the same pointer succeeded). A truly
    invalid range fails again at one alignment unit, after one call per halving. An unregister that
    answers ``cudaErrorHostMemoryNotRegistered`` (713) finds its registration released by
    someone else (``not_registered_codes``). Registered pages
    are resident (``resident``); RLIMIT_MEMLOCK is not declared (``charges_memlock``): whether the
    driver charges it depends on the driver.

    Runs on NVIDIA builds of torch only: on a ROCm build the binding calls HIP, whose codes
    differ; use :class:`RocmRuntime` (``runtime="rocm"``) there.
    """

    name = "cuda"
    capabilities = Capabilities(
        serial_registration=True,
        exact_ranges=True,
        retryable_codes=frozenset({1, 2}),
        not_registered_codes=frozenset({713}),
        resident=True,
        charges_memlock=False,
    )
    _api = CUDA

    @classmethod
    def _require_platform(cls, torch: Any) -> None:
        if torch.version.hip:
            raise ConfigError(
                f"runtime='cuda' runs on NVIDIA CUDA builds of torch, but this is a ROCm build (torch "
                f"{torch.__version__}, HIP {torch.version.hip}), whose registration calls report HIP's codes; "
                "use runtime='rocm' (or 'auto')"
            )
        if not torch.cuda.is_available():
            raise ConfigError(
                "runtime='cuda' needs a CUDA device, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use runtime='mlock' on CPU hosts"
            )
