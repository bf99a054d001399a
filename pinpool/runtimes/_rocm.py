"""RocmRuntime: ``hipHostRegister`` through ``torch.cuda.cudart()`` on ROCm builds of torch."""

from __future__ import annotations

from typing import Any

from .._errors import ConfigError
from .._types import Capabilities
from ._gpu import GpuApi, HostRegisterRuntime

__all__ = ["HIP", "RocmRuntime"]

# hipError_t values worth a name and a hint (current HIP numbers the common codes as CUDA does;
# the host-registration ones differ: 1061/1062, not 712/713); everything else gets
# hipGetErrorName when libamdhip64 can be found, else "hipError<code>".
_HIP_ERRORS: dict[int, tuple[str, str]] = {
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
}  # fmt: skip

HIP = GpuApi(
    runtime="rocm",
    platform="ROCm",
    register_op="hipHostRegister",
    unregister_op="hipHostUnregister",
    error_prefix="hipError",
    unknown_code=999,
    unknown_name="hipErrorUnknown",
    errors=_HIP_ERRORS,
    library="libamdhip64",
    get_last_error="hipGetLastError",
    get_error_name="hipGetErrorName",
)


class RocmRuntime(HostRegisterRuntime):
    """``hipHostRegister``/``hipHostUnregister`` on AMD GPUs, through torch's hipified ``torch.cuda.cudart()``.

    The same logic as :class:`CudaRuntime` (torch's binding keeps its ``cuda*`` names on
    ROCm), with HIP's error table: 2 ``hipErrorOutOfMemory``, 1061
    ``hipErrorHostMemoryAlreadyRegistered``, 1062 ``hipErrorHostMemoryNotRegistered``. A
    failed call's sticky error is cleared with ``hipGetLastError`` from the libamdhip64 torch
    loaded; ``clears_sticky_errors`` says whether it was found. ``device`` is an index or
    ``"cuda:N"`` (torch calls ROCm GPUs ``cuda``).

    Device pointers: separately registered adjacent ranges do **not** get adjacent device
    aliases on ROCm, so a device pointer must never be computed as one chunk's device base plus
    an offset that crosses into another chunk; look it up per chunk. Host pointers are
    contiguous as usual.

    Capabilities: ``hipErrorInvalidValue`` (1) and ``hipErrorOutOfMemory`` (2), HIP's
    equivalents of CUDA's codes for a registration too large, are retryable with a smaller chunk;
    ``hipErrorHostMemoryNotRegistered`` (1062) on unregister means released by someone else
    (``not_registered_codes``). Registration
    is declared serial, like CUDA's (not measured on ROCm: one register worker is the
    conservative default). Exact byte-range tracking is not declared: it is unverified for
    HIP, so neighbours never share an OS page. Registered pages are resident; RLIMIT_MEMLOCK is
    not declared, as for CUDA.
    """

    name = "rocm"
    capabilities = Capabilities(
        serial_registration=True,
        exact_ranges=False,
        retryable_codes=frozenset({1, 2}),
        not_registered_codes=frozenset({1062}),
        resident=True,
        charges_memlock=False,
    )
    _api = HIP

    @classmethod
    def _require_platform(cls, torch: Any) -> None:
        if not torch.version.hip:
            raise ConfigError(
                f"runtime='rocm' needs a ROCm build of torch, but this is torch {torch.__version__} "
                f"(CUDA build {torch.version.cuda}); use runtime='cuda' on NVIDIA GPUs or runtime='mlock' on CPU hosts"
            )
        if not torch.cuda.is_available():
            raise ConfigError(
                "runtime='rocm' needs a ROCm device, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, HIP {torch.version.hip}); use runtime='mlock' on CPU hosts"
            )
