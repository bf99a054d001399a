"""Runtimes: what "pin this range" means. CUDA registration, Linux mlock, or your own.

A runtime is anything with a ``name`` and two thread-safe calls, ``register(ptr, nbytes)``
and ``unregister(ptr)`` (the base of an earlier registration), that raise
:class:`pinpool.RuntimeCallError` carrying the runtime's code and message.

Two optional calls change how PinnedPool pre-faults (``populate=True``):
``populate(ptr, nbytes)`` replaces MADV_POPULATE_WRITE (FakeRuntime uses it to fault-inject
without touching memory), and ``lock_on_fault(ptr, nbytes)``, where present, registers a
chunk *before* it is faulted, so that faulting it on many threads also locks it
(MlockRuntime: mlock2 with MLOCK_ONFAULT). Without it, chunks are faulted first and
registered once faulted (CUDA).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from . import _libc
from ._errors import ConfigError, RuntimeCallError
from ._ranges import RangeBook
from ._units import format_bytes

__all__ = ["CudaRuntime", "MlockRuntime", "Runtime", "resolve_runtime"]


@runtime_checkable
class Runtime(Protocol):
    """What PinnedPool needs from a runtime. Both calls are made from worker threads."""

    name: str

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class MlockRuntime:
    """Real page-locking with Linux ``mlock``/``munlock``, for CPU-only hosts.

    mlock is not CUDA pinning (a GPU copies from it at pageable speed), but it faults, locks
    and accounts pages against RLIMIT_MEMLOCK exactly as pinning does, so tests, demos and
    benchmarks on CPU hosts exercise the real kernel path.
    """

    name = "mlock"

    def __init__(self) -> None:
        self._book = RangeBook()

    @property
    def registered(self) -> dict[int, int]:
        """Bases → sizes this runtime currently holds locked."""
        return self._book.snapshot()

    def register(self, ptr: int, nbytes: int) -> None:
        """mlock: fault in and lock every page of the range."""
        self._lock(ptr, nbytes, _libc.mlock, "mlock")

    def lock_on_fault(self, ptr: int, nbytes: int) -> None:
        """mlock2(MLOCK_ONFAULT): lock the range's resident pages now and the rest as they are faulted in.

        Charged against RLIMIT_MEMLOCK in full at once, like mlock. PinnedPool uses it when it
        pre-faults: it registers each chunk this way first and then faults the chunk on several
        threads, so each page is faulted and locked in one pass.
        """
        self._lock(ptr, nbytes, _libc.mlock_on_fault, "mlock2(MLOCK_ONFAULT)")

    def _lock(self, ptr: int, nbytes: int, call: Callable[[int, int], int], op: str) -> None:
        overlap = self._book.add(ptr, nbytes)
        if overlap is not None:
            raise RuntimeCallError(
                op=op, code=errno.EEXIST, reason="EEXIST", ptr=ptr, nbytes=nbytes,
                message=f"range overlaps [{overlap[0]:#x}, +{overlap[1]}) already locked by this runtime",
            )  # fmt: skip
        err = call(ptr, nbytes)
        if err:
            self._book.pop(ptr)
            raise RuntimeCallError(
                op=op, code=err, reason=_libc.errno_name(err), ptr=ptr, nbytes=nbytes,
                message=mlock_error_message(err, nbytes),
            )  # fmt: skip

    def find_pinned(self, ptr: int, nbytes: int) -> str | None:
        """Describe memory in ``[ptr, ptr+nbytes)`` that is already locked (by anyone), or None."""
        return _locked_in_smaps(ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        nbytes = self._book.pop(ptr)
        if nbytes is None:
            raise RuntimeCallError(
                op="munlock", code=errno.EINVAL, reason="EINVAL", ptr=ptr, nbytes=0,
                message="no range registered at this base (unregister takes the base of an earlier register)",
            )  # fmt: skip
        err = _libc.munlock(ptr, nbytes)
        if err:
            self._book.add(ptr, nbytes)  # still locked: keep it on the books
            raise RuntimeCallError(
                op="munlock", code=err, reason=_libc.errno_name(err), ptr=ptr, nbytes=nbytes,
                message=os.strerror(err),
            )  # fmt: skip


def _locked_in_smaps(ptr: int, nbytes: int) -> str | None:
    """The first mapping of this process overlapping the range with locked pages, per /proc/self/smaps."""
    end = ptr + nbytes
    current: tuple[int, int] | None = None
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    current = (lo, hi) if lo < end and ptr < hi else None
                elif current is not None and head == "Locked:" and int(line.split()[1]) > 0:
                    return f"[{current[0]:#x}, {current[1]:#x}) has {line.split()[1]} kB locked already"
    except OSError:
        return None
    return None


def mlock_error_message(err: int, nbytes: int) -> str:
    """What an mlock errno means for this process, with its limits, and what to do."""
    soft, hard = _libc.memlock_limits()
    cap = _libc.has_cap_ipc_lock()
    limits = (
        f"RLIMIT_MEMLOCK soft {_libc.format_rlimit(soft)}, hard {_libc.format_rlimit(hard)}; "
        f"CAP_IPC_LOCK {'present' if cap else 'absent'}"
    )
    raise_limit = (
        "raise the limit (`ulimit -l unlimited`; systemd `LimitMEMLOCK=infinity`; "
        "docker `--ulimit memlock=-1:-1`; /etc/security/limits.conf `memlock unlimited`) "
        "or grant the process CAP_IPC_LOCK"
    )
    if err == errno.ENOMEM:
        if cap or soft == _libc.RLIM_INFINITY:
            return (
                f"{os.strerror(err)}: the kernel could not lock {format_bytes(nbytes)} although the limit allows it "
                f"({limits}); the host is short of memory: make the pool smaller or free memory"
            )
        return (
            f"{os.strerror(err)}: locking {format_bytes(nbytes)} more would exceed the locked-memory limit "
            f"({limits}); "
            f"{raise_limit}"
        )
    if err == errno.EPERM:
        return f"{os.strerror(err)}: locking is not permitted ({limits}); {raise_limit}"
    if err == errno.EAGAIN:
        return (
            f"{os.strerror(err)}: some of the {format_bytes(nbytes)} could not be locked ({limits}); "
            f"if the limit is the cause, {raise_limit}; otherwise retry or make the pool smaller"
        )
    return f"{os.strerror(err)} ({limits})"


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


def _find_loaded_cudart() -> ctypes.CDLL | None:
    """The libcudart torch already loaded, for the calls torch.cuda.cudart() does not bind."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    # A torch build with cudart linked in statically may still export it globally.
    process = ctypes.CDLL(None)
    return process if hasattr(process, "cudaGetLastError") else None


def _cuda_index(torch: Any, device: int | str) -> int | None:
    parsed = torch.device(device) if isinstance(device, str) else torch.device("cuda", device)
    if parsed.type != "cuda":
        raise ConfigError(f"device={device!r} is not a CUDA device; give an index or 'cuda:N'")
    return int(parsed.index) if parsed.index is not None else int(torch.cuda.current_device())


class CudaRuntime:
    """``cudaHostRegister``/``cudaHostUnregister`` through ``torch.cuda.cudart()``.

    ``device``: the CUDA device the registration is made on (default: torch's current device),
    set in each worker thread for the duration of each call. ``flags``: cudaHostRegister flags
    (0 = default, 1 = portable, 2 = mapped, 8 = read-only).
    A failed registration leaves a sticky "last error"; it is cleared (cudaGetLastError) so the
    next, unrelated CUDA call does not misreport it. That needs libcudart's own symbol, found in
    the libcudart torch loaded or in the process; ``clears_sticky_errors`` says whether it was.
    """

    name = "cuda"

    def __init__(self, device: int | str | None = None, flags: int = 0) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "runtime='cuda' needs a CUDA device, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use runtime='mlock' on CPU hosts"
            )
        if isinstance(flags, bool) or not isinstance(flags, int) or flags < 0:
            raise ConfigError(f"flags={flags!r} must be a non-negative int of cudaHostRegister flags")
        self.device = torch.cuda.current_device() if device is None else _cuda_index(torch, device)
        if self.device is None or not 0 <= self.device < torch.cuda.device_count():
            raise ConfigError(f"device={device!r} is not one of the {torch.cuda.device_count()} visible CUDA devices")
        self.flags = flags
        self._torch = torch
        self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        self._libcudart = _find_loaded_cudart()
        self.clears_sticky_errors = self._libcudart is not None

    def _error(self, op: str, rc: int, ptr: int, nbytes: int) -> RuntimeCallError:
        self._clear_last_error()
        name, hint = _CUDA_ERRORS.get(rc, (self._error_name(rc), ""))
        try:
            text = str(self._cudart.cudaGetErrorString(self._cudart.cudaError(rc)))
        except Exception:  # an enum value torch's binding does not know
            text = f"CUDA error {rc}"
        message = f"{text} (device {self.device})" + (f"; {hint}" if hint else "")
        return RuntimeCallError(op=op, code=rc, reason=name, message=message, ptr=ptr, nbytes=nbytes)

    def _error_name(self, rc: int) -> str:
        if self._libcudart is not None:
            get_name = self._libcudart.cudaGetErrorName
            get_name.restype = ctypes.c_char_p
            raw = get_name(ctypes.c_int(rc))
            if raw:
                return str(raw.decode())
        return f"cudaError{rc}"

    def _clear_last_error(self) -> None:
        if self._libcudart is not None:
            self._libcudart.cudaGetLastError()

    def register(self, ptr: int, nbytes: int) -> None:
        with self._torch.cuda.device(self.device):
            rc = int(self._cudart.cudaHostRegister(ptr, nbytes, self.flags))
        if rc:
            raise self._error("cudaHostRegister", rc, ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        with self._torch.cuda.device(self.device):
            rc = int(self._cudart.cudaHostUnregister(ptr))
        if rc:
            raise self._error("cudaHostUnregister", rc, ptr, 0)


RUNTIME_NAMES = ("auto", "cuda", "mlock")


def resolve_runtime(runtime: str | Runtime) -> Runtime:
    """``"auto"`` (CUDA when torch sees a GPU, else mlock), ``"cuda"``, ``"mlock"``, or an instance."""
    if isinstance(runtime, str):
        if runtime == "auto":
            import torch

            return CudaRuntime() if torch.cuda.is_available() else MlockRuntime()
        if runtime == "cuda":
            return CudaRuntime()
        if runtime == "mlock":
            return MlockRuntime()
        raise ConfigError(
            f"runtime={runtime!r} is not a runtime; choose one of {', '.join(map(repr, RUNTIME_NAMES))} "
            "or pass an object with register(ptr, nbytes) and unregister(ptr), such as pinpool.testing.FakeRuntime()"
        )
    if isinstance(runtime, Runtime) and isinstance(getattr(runtime, "name", None), str):
        return runtime
    raise ConfigError(
        f"runtime={runtime!r} is neither a runtime name ({', '.join(map(repr, RUNTIME_NAMES))}) "
        "nor an object with a str name and register(ptr, nbytes) / unregister(ptr) methods"
    )
