"""Runtimes without a GPU: the name registry, declared capabilities, "auto" on CUDA and ROCm
builds, CudaRuntime's and RocmRuntime's own logic through stubs shaped like torch's binding,
and FakeRuntime's fault rules and hooks."""

from __future__ import annotations

import errno
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import pinpool
from pinpool import _types
from pinpool.runtimes import (
    RUNTIME_NAMES,
    Capabilities,
    CudaRuntime,
    FindsPinned,
    GpuApi,
    HostRegisterRuntime,
    LocksOnFault,
    MlockRuntime,
    Populates,
    RocmRuntime,
    Runtime,
    auto_runtime_name,
    capabilities_of,
    device_index,
    resolve_runtime,
    runtime_choices,
    runtime_info,
    runtime_infos,
)
from pinpool.testing import FakeCudart, FakeRuntime

MiB = 1 << 20
DOCS = Path(__file__).resolve().parents[2] / "docs"


# -- the registry ------------------------------------------------------------------------------


def test_runtime_names_come_from_the_registry() -> None:
    assert isinstance(RUNTIME_NAMES, tuple)
    assert RUNTIME_NAMES[0] == "auto"
    assert set(RUNTIME_NAMES) == {"auto", "cuda", "rocm", "mlock"}
    assert RUNTIME_NAMES == tuple(info.name for info in runtime_infos()) == runtime_choices()
    assert len(set(RUNTIME_NAMES)) == len(RUNTIME_NAMES)
    for info in runtime_infos():
        assert runtime_info(info.name) is info
        assert info.description and "\n" not in info.description and len(info.description) <= 100


def test_every_registered_name_has_a_row_in_the_operations_runtime_table() -> None:
    text = (DOCS / "operations.md").read_text()
    rows = set(re.findall(r"^\| `([a-z]+)` \|", text, flags=re.MULTILINE))
    missing = [name for name in RUNTIME_NAMES if name not in rows]
    assert not missing, f"docs/operations.md has no table row for runtime(s) {missing}"


def test_unknown_name_is_a_config_error_listing_the_names() -> None:
    with pytest.raises(pinpool.ConfigError, match=r"runtime='tpu' is not a runtime; choose one of 'auto', 'cuda'"):
        resolve_runtime("tpu")
    with pytest.raises(pinpool.ConfigError, match="runtime='tpu'"):
        runtime_info("tpu")


def test_objects_resolve_as_themselves_and_non_runtimes_are_rejected(fake: FakeRuntime) -> None:
    assert resolve_runtime(fake) is fake
    assert isinstance(resolve_runtime("mlock"), MlockRuntime)
    with pytest.raises(pinpool.ConfigError, match="neither a runtime name"):
        resolve_runtime(object())  # type: ignore[arg-type]


def test_availability_here() -> None:
    assert runtime_info("auto").available() and runtime_info("mlock").available()
    gpu = torch.cuda.is_available()
    assert runtime_info("cuda").available() == (gpu and not torch.version.hip)
    assert runtime_info("rocm").available() == (gpu and bool(torch.version.hip))


# -- capabilities ------------------------------------------------------------------------------


def test_capabilities_is_the_shared_value_type() -> None:
    assert Capabilities is _types.Capabilities
    assert Capabilities() == Capabilities(
        populates=False, locks_on_fault=False, finds_pinned=False, serial_registration=False,
        exact_ranges=False, retryable_codes=frozenset(),
    )  # fmt: skip


def test_declared_capabilities_of_the_built_in_runtimes() -> None:
    mlock = capabilities_of(MlockRuntime())
    assert mlock == Capabilities(
        locks_on_fault=True, finds_pinned=True, exact_ranges=True, charges_memlock=True,
        not_registered_codes=frozenset({errno.EINVAL}),
    )  # fmt: skip
    assert mlock.exact_ranges and mlock.retryable_codes == frozenset()  # shared pages are counted
    # EINVAL: its books' "no range registered at this base" (a register that failed untrusted, never booked)
    assert CudaRuntime.capabilities == Capabilities(
        serial_registration=True,
        exact_ranges=True,
        retryable_codes=frozenset({1, 2}),
        not_registered_codes=frozenset({713}),
        already_registered_codes=frozenset({712}),
        stale_codes=True,  # a failed register is checked by unregistering it (issue 33 item 4)
    )
    assert RocmRuntime.capabilities.retryable_codes == frozenset({1, 2})
    assert RocmRuntime.capabilities.stale_codes and RocmRuntime.capabilities.already_registered_codes == {1061}
    assert RocmRuntime.capabilities.serial_registration and not RocmRuntime.capabilities.exact_ranges
    cuda = CudaRuntime.from_binding(FakeCudart(lock=False))
    assert capabilities_of(cuda) is CudaRuntime.capabilities
    assert isinstance(MlockRuntime(), LocksOnFault) and isinstance(MlockRuntime(), FindsPinned)


@pytest.mark.parametrize("lock_on_fault", [False, True])
def test_fake_runtime_declares_what_it_was_asked_to_be(lock_on_fault: bool) -> None:
    fake = FakeRuntime(lock_on_fault=lock_on_fault)
    assert capabilities_of(fake) == Capabilities(
        populates=True, locks_on_fault=lock_on_fault, exact_ranges=True, retryable_codes=frozenset({2}),
        not_registered_codes=frozenset({713}), resident=False,
    )  # fmt: skip
    assert isinstance(fake, Populates) and isinstance(fake, LocksOnFault)  # the method is always there


class Plain:
    """A user's runtime written against the two required calls only."""

    name = "plain"

    def register(self, ptr: int, nbytes: int) -> None:
        pass

    def unregister(self, ptr: int) -> None:
        pass


def test_a_runtime_that_declares_nothing_gets_nothing() -> None:
    class WithStrayMethods(Plain):  # methods alone switch nothing on: only the declaration does
        def populate(self, ptr: int, nbytes: int) -> None:
            pass

        def lock_on_fault(self, ptr: int, nbytes: int) -> None:
            pass

    assert capabilities_of(Plain()) == Capabilities()
    assert capabilities_of(WithStrayMethods()) == Capabilities()
    assert resolve_runtime(Plain()).name == "plain"


@pytest.mark.parametrize(
    ("declared", "fix"),
    [
        (Capabilities(populates=True), r"declares populates=True but has no callable populate; define populate\("),
        (Capabilities(locks_on_fault=True), "lock_on_fault; define lock_on_fault.*or declare locks_on_fault=False"),
        (Capabilities(finds_pinned=True), r"find_pinned; define find_pinned\(ptr, nbytes\) -> str \| None"),
    ],
)
def test_declaring_an_ability_without_its_method_is_a_config_error(declared: Capabilities, fix: str) -> None:
    class Liar(Plain):
        capabilities = declared

    with pytest.raises(pinpool.ConfigError, match=f"runtime 'plain' \\(.*Liar\\) .*{fix}"):
        capabilities_of(Liar())
    with pytest.raises(pinpool.ConfigError, match="Liar"):
        resolve_runtime(Liar())  # resolving checks the declaration
    with pytest.raises(pinpool.ConfigError, match="Liar"):
        pinpool.PinnedPool(size=MiB, runtime=Liar())


def test_a_declared_method_that_is_not_callable_is_a_config_error() -> None:
    class NotCallable(Plain):
        capabilities = Capabilities(finds_pinned=True)
        find_pinned = "yes"

    with pytest.raises(pinpool.ConfigError, match="no callable find_pinned"):
        capabilities_of(NotCallable())


def test_a_declaration_that_is_not_capabilities_is_a_config_error() -> None:
    class Named(Plain):
        capabilities = "populates"

    with pytest.raises(
        pinpool.ConfigError, match=r"declares capabilities='populates', .*declare Capabilities\(\.\.\.\)"
    ):
        capabilities_of(Named())


# -- "auto" and the platform checks --------------------------------------------------------------


class StubErrorEnum:
    """Like the binding's pybind11 ``cudaError`` enum: built from a code, unknown codes rejected here."""

    known: frozenset[int] = frozenset()

    def __init__(self, code: int) -> None:
        if code not in self.known:
            raise ValueError(f"{code} is not a valid cudaError")
        self.value = code


class IntLike:
    """What the binding returns: an enum value with __int__, not an int."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value


class StubDevices:
    """Stands in for ``torch.cuda.device``: makes a device current in the calling thread only."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.entered: list[tuple[int, int]] = []  # (thread ident, device)
        self._lock = threading.Lock()

    @property
    def current(self) -> int | None:
        return getattr(self._local, "device", None)

    @contextmanager
    def __call__(self, device: int) -> Iterator[None]:
        with self._lock:
            self.entered.append((threading.get_ident(), device))
        previous, self._local.device = self.current, device
        try:
            yield
        finally:
            self._local.device = previous


class StubCudart:
    """The shape of ``torch.cuda.cudart()``: returns scripted codes and leaves a failure pending
    in the calling thread, as the real runtime's sticky last error."""

    def __init__(self, devices: StubDevices, texts: dict[int, str]) -> None:
        self.devices = devices
        self.texts = texts
        self.codes: dict[int, int] = {}  # ptr -> code to return
        self.calls: list[tuple[str, int, int, int, int, int | None]] = []  # op, ptr, nbytes, flags, thread, device
        self.pending: dict[int, int] = {}  # thread ident -> sticky error
        self.cudaError = type("cudaError", (StubErrorEnum,), {"known": frozenset(texts)})
        self._lock = threading.Lock()

    def _call(self, op: str, ptr: int, nbytes: int, flags: int) -> IntLike:
        rc = self.codes.get(ptr, 0)
        with self._lock:
            self.calls.append((op, ptr, nbytes, flags, threading.get_ident(), self.devices.current))
            if rc:
                self.pending[threading.get_ident()] = rc
        return IntLike(rc)

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> IntLike:
        return self._call("register", ptr, nbytes, flags)

    def cudaHostUnregister(self, ptr: int) -> IntLike:
        return self._call("unregister", ptr, 0, -1)

    def cudaGetErrorString(self, error: StubErrorEnum) -> str:
        return self.texts[error.value]


class StubLibrary:
    """The loaded libcudart / libamdhip64: clears the calling thread's pending error, names codes."""

    def __init__(self, api: GpuApi, binding: StubCudart, names: dict[int, bytes], unknown: bytes) -> None:
        self.binding = binding
        self.names = names
        self.unknown = unknown
        self.cleared: list[tuple[int, int | None]] = []  # (thread ident, error it cleared)
        setattr(self, api.get_last_error, self._get_last_error)
        setattr(self, api.get_error_name, self._get_error_name)

    def _get_last_error(self) -> int:
        error = self.binding.pending.pop(threading.get_ident(), 0)
        self.cleared.append((threading.get_ident(), error))
        return error

    def _get_error_name(self, code: int) -> bytes | None:
        return self.names.get(code, self.unknown)


# Per runtime: the binding's texts, the library's names and its answer for codes it does not know.
PLATFORMS: dict[type[HostRegisterRuntime], dict[str, Any]] = {
    CudaRuntime: {
        "texts": {2: "out of memory", 712: "part or all of the requested memory range is already mapped",
                  713: "pointer does not correspond to a registered memory region", 4242: "a new error"},
        "names": {4242: b"cudaErrorSomethingNew"},
        "unknown": b"unrecognized error code",
        "oom": (2, "cudaErrorMemoryAllocation", "cudaHostRegister"),
        "already": (712, "cudaErrorHostMemoryAlreadyRegistered"),
        "not_registered": (713, "cudaErrorHostMemoryNotRegistered", "cudaHostUnregister"),
        "prefix": "cudaError",
        "platform": "CUDA",
    },
    RocmRuntime: {
        "texts": {2: "out of memory", 1061: "part or all of the requested memory range is already mapped",
                  1062: "pointer does not correspond to a registered memory region", 4242: "a new error"},
        "names": {4242: b"hipErrorSomethingNew"},
        "unknown": b"hipErrorUnknown",
        "oom": (2, "hipErrorOutOfMemory", "hipHostRegister"),
        "already": (1061, "hipErrorHostMemoryAlreadyRegistered"),
        "not_registered": (1062, "hipErrorHostMemoryNotRegistered", "hipHostUnregister"),
        "prefix": "hipError",
        "platform": "ROCm",
    },
}  # fmt: skip


@pytest.fixture
def stub_runtime(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``build(cls, device=, flags=, library=)``: the runtime on a stub binding and library through the
    public ``from_binding``, with torch looking like it sees a GPU so that ``torch.cuda.device`` (the
    stub devices here) is what makes the device current."""
    devices = StubDevices()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", devices)

    def build(
        cls: type[HostRegisterRuntime], *, device: int = 3, flags: int = 2, library: bool = True
    ) -> tuple[Any, StubCudart, StubLibrary, StubDevices]:
        platform = PLATFORMS[cls]
        binding = StubCudart(devices, platform["texts"])
        lib = StubLibrary(cls._api, binding, platform["names"], platform["unknown"])
        runtime = cls.from_binding(binding, library=lib if library else None, device=device, flags=flags)
        return runtime, binding, lib, devices

    return build


@pytest.fixture
def gpu_build(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make this CPU torch look like a GPU build with 2 devices; set ``torch.version.hip`` to taste."""
    devices = StubDevices()

    def build(hip: str | None) -> StubCudart:
        binding = StubCudart(devices, {})
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: binding)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.version, "cuda", None if hip else "12.4")
        return binding

    return build


def test_auto_without_a_gpu_is_mlock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")  # a ROCm build without a GPU: still mlock
    assert auto_runtime_name() == "mlock"
    assert isinstance(resolve_runtime("auto"), MlockRuntime)


def test_auto_on_a_cuda_build_is_cuda(gpu_build: Any) -> None:
    binding = gpu_build(None)
    assert auto_runtime_name() == "cuda"
    runtime = resolve_runtime("auto")
    assert type(runtime) is CudaRuntime and runtime.device == 1 and runtime._binding is binding
    assert runtime_info("cuda").available() and not runtime_info("rocm").available()


def test_auto_on_a_rocm_build_is_rocm(gpu_build: Any) -> None:
    """On ROCm torch.cuda.is_available() is true too; only torch.version.hip tells the builds apart."""
    binding = gpu_build("6.2.41133")
    assert auto_runtime_name() == "rocm"
    runtime = resolve_runtime("auto")
    assert type(runtime) is RocmRuntime and runtime.name == "rocm" and runtime._binding is binding
    assert runtime_info("rocm").available() and not runtime_info("cuda").available()
    assert isinstance(RocmRuntime(device="cuda:0"), RocmRuntime)  # torch calls ROCm GPUs "cuda"


def test_cuda_on_a_rocm_build_and_rocm_on_a_cuda_build_are_config_errors(gpu_build: Any) -> None:
    gpu_build("6.2.41133")
    with pytest.raises(pinpool.ConfigError, match=r"runtime='cuda' .* ROCm build .*HIP 6\.2.*use runtime='rocm'"):
        resolve_runtime("cuda")
    gpu_build(None)
    with pytest.raises(pinpool.ConfigError, match=r"runtime='rocm' needs a ROCm build .*CUDA build 12\.4.*'cuda'"):
        resolve_runtime("rocm")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages of a host without a GPU")
def test_gpu_runtimes_without_a_gpu_point_to_mlock() -> None:
    with pytest.raises(pinpool.ConfigError, match=r"runtime='cuda' needs a CUDA device.*runtime='mlock'"):
        resolve_runtime("cuda")
    with pytest.raises(pinpool.ConfigError, match=r"runtime='rocm'.*runtime='mlock'"):
        resolve_runtime("rocm")


@pytest.mark.parametrize(
    ("device", "match"),
    [(5, "not one of the 2 visible CUDA devices"), (-1, "non-negative"), (True, "must be a device index"),
     ("cpu", "not a GPU device"), ("nonsense", "is not a device")],
)  # fmt: skip
def test_bad_devices_are_config_errors(gpu_build: Any, device: object, match: str) -> None:
    gpu_build(None)
    with pytest.raises(pinpool.ConfigError, match=match):
        CudaRuntime(device=device)  # type: ignore[arg-type]


def test_device_strings(gpu_build: Any) -> None:
    gpu_build(None)
    assert device_index(torch, "cuda:1", "cuda") == 1
    assert device_index(torch, "cuda", "cuda") == 1  # no index: torch's current device
    assert CudaRuntime(device="cuda:0").device == 0 and CudaRuntime().device == 1


@pytest.mark.parametrize("flags", [-1, True, 1.0])
def test_bad_flags_are_config_errors(flags: object, stub_runtime: Any) -> None:
    with pytest.raises(pinpool.ConfigError, match=r"flags=.*non-negative int of cudaHostRegister flags"):
        stub_runtime(CudaRuntime, flags=flags)


# -- CudaRuntime's and RocmRuntime's logic through the stubs --------------------------------------

gpu_runtimes = pytest.mark.parametrize("cls", [CudaRuntime, RocmRuntime])


@gpu_runtimes
def test_success_sets_the_device_passes_flags_and_clears_nothing(
    cls: type[HostRegisterRuntime], stub_runtime: Any
) -> None:
    runtime, binding, lib, devices = stub_runtime(cls)
    assert runtime.clears_sticky_errors and isinstance(runtime, Runtime)
    runtime.register(0x1000, 4096)
    runtime.unregister(0x1000)
    me = threading.get_ident()
    assert binding.calls == [("register", 0x1000, 4096, 2, me, 3), ("unregister", 0x1000, 0, -1, me, 3)]
    assert devices.entered == [(me, 3), (me, 3)] and devices.current is None  # restored after each call
    assert lib.cleared == []
    assert repr(runtime) == f"{cls.__name__}(device=3, flags=2)"


@gpu_runtimes
def test_register_failure_is_named_hinted_and_its_sticky_error_cleared_once(
    cls: type[HostRegisterRuntime], stub_runtime: Any
) -> None:
    platform = PLATFORMS[cls]
    code, reason, op = platform["oom"]
    runtime, binding, lib, _devices = stub_runtime(cls)
    binding.codes[0x2000] = code
    with pytest.raises(pinpool.RuntimeCallError) as info:
        runtime.register(0x2000, 8 * MiB)
    error = info.value
    assert (error.op, error.code, error.reason, error.ptr, error.nbytes) == (op, code, reason, 0x2000, 8 * MiB)
    assert error.message.startswith("out of memory (device 3); the driver could not pin this chunk: lower chunk_bytes=")
    assert lib.cleared == [(threading.get_ident(), code)]  # exactly once, in the failing thread
    assert binding.pending == {}  # the next, unrelated call would not see it
    assert code in capabilities_of(runtime).retryable_codes


@gpu_runtimes
def test_already_registered_and_not_registered_use_the_platforms_codes(cls: type[HostRegisterRuntime]) -> None:
    """On FakeCudart's books (the platform's own codes for a real overlap and a real non-base)."""
    platform = PLATFORMS[cls]
    fake = FakeCudart(platform=cls.name, lock=False)
    runtime = cls.from_binding(fake)
    runtime.register(0x1000, 8192)
    already, already_name = platform["already"]
    with pytest.raises(pinpool.RuntimeCallError) as info:
        runtime.register(0x2000, 4096)  # overlaps the second half
    assert (info.value.code, info.value.reason) == (already, already_name)
    assert "already registered" in info.value.message
    missing, missing_name, op = platform["not_registered"]
    with pytest.raises(pinpool.RuntimeCallError) as info:
        runtime.unregister(0x2000)  # inside a registration, not its base
    assert (info.value.op, info.value.code, info.value.reason, info.value.nbytes) == (op, missing, missing_name, 0)
    assert "not the base of a registration" in info.value.message
    assert [rc for *_call, rc in fake.calls] == [0, already, missing]
    assert fake.cudaGetLastError() == 0  # each failure's sticky error was cleared
    assert fake.registered == {0x1000: 8192}


@gpu_runtimes
def test_unknown_codes_get_a_name(cls: type[HostRegisterRuntime], stub_runtime: Any) -> None:
    prefix, platform = PLATFORMS[cls]["prefix"], PLATFORMS[cls]["platform"]
    runtime, binding, _lib, _devices = stub_runtime(cls)
    binding.codes.update({0x5000: 4242, 0x6000: 4343})
    with pytest.raises(pinpool.RuntimeCallError) as info:  # the library knows it
        runtime.register(0x5000, 4096)
    assert info.value.reason == f"{prefix}SomethingNew" and info.value.message == "a new error (device 3)"
    with pytest.raises(pinpool.RuntimeCallError) as info:  # it does not ("unrecognized ..."/"...Unknown")
        runtime.register(0x6000, 4096)
    assert info.value.reason == f"{prefix}4343"
    assert info.value.message == f"{platform} error 4343 (device 3)"  # nor does the binding's enum


@gpu_runtimes
def test_without_the_library_names_fall_back_and_nothing_is_cleared(
    cls: type[HostRegisterRuntime], stub_runtime: Any
) -> None:
    prefix = PLATFORMS[cls]["prefix"]
    runtime, binding, _lib, _devices = stub_runtime(cls, library=False)
    assert not runtime.clears_sticky_errors
    binding.codes[0x5000] = 4242
    with pytest.raises(pinpool.RuntimeCallError) as info:
        runtime.register(0x5000, 4096)
    assert info.value.reason == f"{prefix}4242"
    assert binding.pending == {threading.get_ident(): 4242}  # nothing could clear it


@gpu_runtimes
def test_each_calling_thread_sets_the_device_and_clears_its_own_error(
    cls: type[HostRegisterRuntime], stub_runtime: Any
) -> None:
    code = PLATFORMS[cls]["oom"][0]
    runtime, binding, lib, devices = stub_runtime(cls, device=1)
    binding.codes[0x9000] = code  # thread 1's second call fails
    meet = threading.Barrier(2, timeout=10)
    errors: dict[int, list[int]] = {}

    def work(base: int) -> None:
        meet.wait()  # both threads call at once
        codes = errors.setdefault(threading.get_ident(), [])
        for ptr in (base, base + 0x1000):
            try:
                runtime.register(ptr, 4096)
            except pinpool.RuntimeCallError as exc:
                codes.append(exc.code)

    threads = [threading.Thread(target=work, args=(base,)) for base in (0x8000, 0x10000)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    idents = {thread.ident for thread in threads}
    assert {ident for _op, _ptr, _n, _f, ident, _device in binding.calls} == idents
    assert all(device == 1 for *_rest, device in binding.calls)  # made current in the calling thread
    assert sorted(devices.entered) == sorted((ident, 1) for ident in idents for _ in range(2))
    assert devices.current is None  # this thread was never switched
    failing, other = threads[0].ident, threads[1].ident
    assert failing is not None and other is not None
    assert errors[failing] == [code] and errors[other] == []
    assert lib.cleared == [(failing, code)] and binding.pending == {}


# -- FakeRuntime: fault rules and hooks ----------------------------------------------------------


def test_lock_on_fault_is_a_register_call() -> None:
    fake = FakeRuntime()
    fake.lock_on_fault(0x1000, 4096)
    assert fake.register_calls == [(0x1000, 4096)] and fake.registered == {0x1000: 4096}
    assert fake.events == [("register", 0x1000)]


@pytest.mark.parametrize("cap", [2 * MiB, "2MiB"])
def test_fail_register_larger_than_acts_as_a_driver_cap(cap: int | str) -> None:
    fake = FakeRuntime(fail_register_larger_than=cap)
    fake.register(0, 2 * MiB)  # at the cap: fine
    with pytest.raises(pinpool.RuntimeCallError) as info:
        fake.register(4 * MiB, 2 * MiB + 1)
    assert (info.value.code, info.value.reason, info.value.op) == (2, "cudaErrorMemoryAllocation", "cudaHostRegister")
    assert "per-call cap" in info.value.message
    assert fake.registered == {0: 2 * MiB}
    assert fake.register_calls == [(0, 2 * MiB), (4 * MiB, 2 * MiB + 1)]


@pytest.mark.parametrize("cap", ["tiny", 0, -1, True])
def test_bad_register_cap_is_a_config_error(cap: object) -> None:
    with pytest.raises(pinpool.ConfigError, match="fail_register_larger_than="):
        FakeRuntime(fail_register_larger_than=cap)  # type: ignore[arg-type]


def test_fail_next_register() -> None:
    fake = FakeRuntime()
    fake.register(0, 4096)
    fake.fail_next(2)
    for ptr in (4096, 8192):
        with pytest.raises(pinpool.RuntimeCallError, match="fail_next, register call #") as info:
            fake.register(ptr, 4096)
        assert info.value.code == 2
    fake.register(4096, 4096)  # the third call after arming succeeds
    assert fake.registered == {0: 4096, 4096: 4096}
    fake.fail_next(3)
    fake.fail_next(0)  # replaces: disarmed
    fake.register(8192, 4096)


def test_fail_next_unregister_keeps_the_range_registered(fake: FakeRuntime) -> None:
    fake.register(0, 4096)
    fake.fail_next(1, op="unregister")
    with pytest.raises(pinpool.RuntimeCallError) as info:
        fake.unregister(0)
    assert (info.value.op, info.value.code, info.value.reason) == ("cudaHostUnregister", 2, "cudaErrorMemoryAllocation")
    assert fake.registered == {0: 4096}
    fake.unregister(0)
    assert fake.registered == {} and fake.unregister_calls == [0, 0]


def test_fail_next_populate_is_enomem(fake: FakeRuntime) -> None:
    fake.fail_next(1, op="populate")
    with pytest.raises(pinpool.RuntimeCallError) as info:
        fake.populate(0, MiB)
    assert (info.value.op, info.value.code, info.value.reason) == ("madvise(MADV_POPULATE_WRITE)", 12, "ENOMEM")
    fake.populate(0, MiB)
    assert fake.populate_calls == [(0, MiB), (0, MiB)]


@pytest.mark.parametrize(("k", "op", "match"), [(1, "mlock", "op='mlock' is not a FakeRuntime call"),
                                                (-1, "register", "k=-1"), (True, "register", "k=True")])  # fmt: skip
def test_bad_fail_next_is_a_config_error(fake: FakeRuntime, k: int, op: str, match: str) -> None:
    with pytest.raises(pinpool.ConfigError, match=match):
        fake.fail_next(k, op)


def test_fail_next_counts_exactly_under_concurrency() -> None:
    fake = FakeRuntime(register_delay=0.001)
    fake.fail_next(5)
    failures: list[int] = []
    lock = threading.Lock()

    def work(ptr: int) -> None:
        try:
            fake.register(ptr, 4096)
        except pinpool.RuntimeCallError:
            with lock:
                failures.append(ptr)

    threads = [threading.Thread(target=work, args=(i * 4096,)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(failures) == 5 and len(fake.registered) == 15 and len(fake.register_calls) == 20


def test_hooks_run_around_every_call_and_after_sees_the_books(fake: FakeRuntime) -> None:
    seen: list[tuple[str, str, int, int, bool]] = []

    def before(op: str, ptr: int, nbytes: int) -> None:
        seen.append(("before", op, ptr, nbytes, ptr in fake.registered))

    def after(op: str, ptr: int, nbytes: int) -> None:
        seen.append(("after", op, ptr, nbytes, ptr in fake.registered))

    fake.before_call, fake.after_call = before, after  # plain attributes, settable after construction
    fake.populate(0, MiB)
    fake.register(0, MiB)
    fake.fail_next(1)
    with pytest.raises(pinpool.RuntimeCallError):
        fake.register(MiB, MiB)  # after_call runs on failure too
    fake.unregister(0)
    assert seen == [
        ("before", "populate", 0, MiB, False), ("after", "populate", 0, MiB, False),
        ("before", "register", 0, MiB, False), ("after", "register", 0, MiB, True),
        ("before", "register", MiB, MiB, False), ("after", "register", MiB, MiB, False),
        ("before", "unregister", 0, 0, True), ("after", "unregister", 0, 0, False),
    ]  # fmt: skip


class Interrupt(BaseException):
    pass


def test_a_before_hook_that_raises_stops_the_call_before_it_happens() -> None:
    after: list[str] = []

    def interrupt(op: str, ptr: int, nbytes: int) -> None:
        raise Interrupt(op)

    fake = FakeRuntime(before_call=interrupt, after_call=lambda op, ptr, nbytes: after.append(op))
    with pytest.raises(Interrupt):
        fake.register(0, 4096)
    assert fake.register_calls == [] and fake.events == [] and fake.registered == {} and after == []


def test_an_after_hook_that_raises_propagates_with_the_range_registered() -> None:
    def interrupt_second(op: str, ptr: int, nbytes: int) -> None:
        if ptr == 4096:
            raise Interrupt(f"{op} {ptr}")

    fake = FakeRuntime(after_call=interrupt_second)
    fake.register(0, 4096)
    with pytest.raises(Interrupt, match="register 4096"):
        fake.register(4096, 4096)
    assert fake.registered == {0: 4096, 4096: 4096}  # the "driver" registered it before the interrupt
    assert fake.max_concurrent_registers == 1


def test_an_after_hook_error_wins_over_the_calls_own_failure() -> None:
    def interrupt(op: str, ptr: int, nbytes: int) -> None:
        raise Interrupt(op)

    fake = FakeRuntime(fail_register_on=1, after_call=interrupt)
    with pytest.raises(Interrupt) as info:
        fake.register(0, 4096)
    assert isinstance(info.value.__context__, pinpool.RuntimeCallError)


@pytest.mark.parametrize("what", ["before_call", "after_call"])
def test_hooks_must_be_callable(what: str) -> None:
    with pytest.raises(pinpool.ConfigError, match=f"{what}=3 must be None or a callable"):
        FakeRuntime(**{what: 3})  # type: ignore[arg-type]


def test_a_pool_over_the_fake_reports_the_capped_chunk_and_rolls_back() -> None:
    fake = FakeRuntime(fail_register_larger_than=MiB)
    with pytest.raises(pinpool.PinError) as info:
        with pinpool.PinnedPool(
            size=4 * MiB, chunk_bytes=2 * MiB, runtime=fake, populate=False, register_workers=1, max_retries=0
        ):
            pytest.fail("body must not run")
    assert info.value.code == 2
    assert fake.registered == {}
