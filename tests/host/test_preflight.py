"""The pre-flight: a pool that cannot fit in the memory the process may still make resident (its
memory cgroup, MemAvailable) or in RLIMIT_MEMLOCK is a ConfigError before anything is mapped;
what cannot be known in advance (ENOMEM, EAGAIN while pinning) is a PinError after a full
rollback. Ends with a real memory cgroup: a 4 GiB pool in 2 GiB must be refused, not OOM-killed."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch

import pinpool
from pinpool import ConfigError, _probe, layouts
from pinpool._host import libc as _libc
from pinpool._plan import HostFacts, PoolOptions
from pinpool._types import Capabilities
from pinpool.runtimes import MlockRuntime, pinning_capabilities
from pinpool.testing import FakeRuntime, host_facts, locked_bytes

from .. import preloaded
from ..conftest import check_host, needs_mlock

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
HUGE = 2 * MiB

# A CPU-only host with 16 GiB available and no cgroup limit, root-like (CAP_IPC_LOCK).
HOST = host_facts(huge_page_size=HUGE, memlock_soft=8 * MiB, memlock_hard=8 * MiB, mem_available=16 * GiB)
CONTAINER = dataclasses.replace(
    HOST, cgroup_memory_limit=2 * GiB, cgroup_memory_usage=300 * MiB, cgroup_memory_reclaimable=12 * MiB,
    cgroup_version=2, cgroup_path="/kubepods/pod1/c1",
)  # fmt: skip
NO_CAP = dataclasses.replace(HOST, cap_ipc_lock=False, memlock_soft=64 * MiB, memlock_hard=GiB, locked_bytes=8 * MiB)
GPU_HOST = dataclasses.replace(HOST, torch_cuda="12.4", nvidia_driver=True)

REAL_RUNTIMES = ("auto", "mlock", "cuda", "rocm")


def refusal(options: PoolOptions, host: HostFacts, runtime: object = "mlock", **kwargs: bool) -> str:
    with pytest.raises(ConfigError) as info:
        check_host(options, host, runtime, **kwargs)
    return str(info.value)


# -- memory: the cgroup's room and MemAvailable ----------------------------------------------------------


@pytest.mark.parametrize("runtime", REAL_RUNTIMES)
def test_a_pool_beyond_the_cgroup_is_refused_naming_requested_available_and_the_fix(runtime: str) -> None:
    message = refusal(PoolOptions(size=4 * GiB), CONTAINER, runtime)
    assert message.startswith("size=4294967296 B = 4 GiB cannot be pinned here: it needs 4.01 GiB of memory")
    assert "(4 GiB of pages plus 8 MiB of page tables)" in message
    # available: the cgroup's limit, usage and page cache, and MemAvailable
    assert "but only 1.72 GiB is available: the memory cgroup /kubepods/pod1/c1 (cgroup v2)" in message
    assert "has a limit of 2 GiB (300 MiB in use, 12 MiB of it reclaimable page cache), leaving 1.72 GiB" in message
    assert "MemAvailable is 16 GiB" in message
    assert "OOM-killed (exit 137)" in message
    # the fixes
    assert "Give a smaller size (at most 1.72 GiB fits now)" in message
    assert "raise the container's memory limit (memory.max of that cgroup" in message
    assert "or free memory in it; nothing has been mapped or pinned" in message


def test_v1_names_its_limit_file() -> None:
    message = refusal(PoolOptions(size=4 * GiB), dataclasses.replace(CONTAINER, cgroup_version=1))
    assert "(cgroup v1)" in message and "memory.limit_in_bytes of that cgroup" in message


def test_mem_available_binds_without_a_cgroup_limit() -> None:
    message = refusal(PoolOptions(size=32 * GiB), HOST)
    assert "but only 16 GiB is available: MemAvailable is 16 GiB and no memory cgroup limit applies" in message
    assert "or free memory on the host" in message and "container" not in message


def test_mem_available_binds_inside_a_roomy_cgroup() -> None:
    host = dataclasses.replace(CONTAINER, cgroup_memory_limit=64 * GiB)
    message = refusal(PoolOptions(size=32 * GiB), host)
    assert "only 16 GiB is available: MemAvailable is 16 GiB (the memory cgroup" in message
    assert "or free memory on the host" in message


def test_a_pool_that_fits_passes_and_page_tables_count() -> None:
    room = CONTAINER.cgroup_room
    assert room == 2 * GiB - 288 * MiB
    fit = room * 4096 // 4104 // 4096 * 4096
    check_host(PoolOptions(size=fit), CONTAINER, "mlock")
    with pytest.raises(ConfigError, match="cannot be pinned here"):
        check_host(PoolOptions(size=fit + 4096), CONTAINER, "mlock")
    with pytest.raises(ConfigError, match="cannot be pinned here"):  # fits without its page tables, not with
        check_host(PoolOptions(size=room - 4096), CONTAINER, "mlock")


def test_unknown_figures_are_not_guessed_at() -> None:
    unknown = dataclasses.replace(HOST, mem_available=None)
    check_host(PoolOptions(size=TiB), unknown, "mlock")


@pytest.mark.parametrize("runtime", [None, "fake", "no-such-runtime"])
def test_no_memory_check_without_a_runtime_that_pins_for_real(fake: FakeRuntime, runtime: str | None) -> None:
    """FakeRuntime touches no memory: tests plan pools far beyond the host. An unknown name is left
    to resolve_runtime's own ConfigError; None keeps the old, runtime-free check_host."""
    spec: object = fake if runtime == "fake" else runtime
    check_host(PoolOptions(size=64 * GiB), CONTAINER, spec)
    check_host(PoolOptions(size=64 * GiB), NO_CAP, spec)


def test_hugetlb_pages_are_reserved_not_charged() -> None:
    host = dataclasses.replace(CONTAINER, hugetlb_free=4096, hugetlb_total=4096)
    check_host(PoolOptions(size=4 * GiB, huge_pages="hugetlb"), host, "mlock")
    with pytest.raises(ConfigError, match="cannot be pinned here"):
        check_host(PoolOptions(size=4 * GiB, huge_pages=True), host, "mlock")


def test_a_callers_tensor_is_not_charged_again() -> None:
    """pin() of memory the caller allocated: it may be resident (and counted in the usage) already."""
    check_host(PoolOptions(size=4 * GiB), CONTAINER, "mlock", new_memory=False)


def test_the_old_checks_come_first() -> None:
    small_space = dataclasses.replace(CONTAINER, address_space_bytes=1 << 39)
    assert "of address space" in refusal(PoolOptions(size=(1 << 39) + 4096), small_space)
    assert "is not a NUMA node" in refusal(PoolOptions(size=4 * GiB, numa_node=3), CONTAINER)


# -- RLIMIT_MEMLOCK ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("runtime", ["mlock", "auto", MlockRuntime()])
def test_memlock_budget_without_cap_ipc_lock(runtime: object) -> None:
    message = refusal(PoolOptions(size=GiB), NO_CAP, runtime)
    assert message.startswith(
        "size=1073741824 B = 1 GiB needs 1 GiB locked with mlock, but RLIMIT_MEMLOCK leaves only 56 MiB: "
        "soft limit 64 MiB (hard 1 GiB), 8 MiB already locked by this process (VmLck), and no CAP_IPC_LOCK"
    )
    assert "`ulimit -l unlimited`" in message and "grant the process CAP_IPC_LOCK" in message
    assert "or give a smaller size (at most 56 MiB fits now); nothing has been mapped or pinned" in message
    check_host(PoolOptions(size=56 * MiB), NO_CAP, runtime)
    with pytest.raises(ConfigError, match="RLIMIT_MEMLOCK leaves only"):
        check_host(PoolOptions(size=56 * MiB + 1), NO_CAP, runtime)  # whole pages are locked


@pytest.mark.parametrize(
    "host",
    [
        dataclasses.replace(NO_CAP, cap_ipc_lock=True),
        dataclasses.replace(NO_CAP, memlock_soft=None),
    ],
    ids=["cap_ipc_lock", "unlimited"],
)
def test_memlock_needs_no_budget_with_the_capability_or_no_limit(host: HostFacts) -> None:
    check_host(PoolOptions(size=GiB), host, "mlock")


@pytest.mark.parametrize("runtime", ["cuda", "rocm"])
def test_gpu_runtimes_are_not_held_to_rlimit_memlock(runtime: str) -> None:
    """Whether the GPU driver charges RLIMIT_MEMLOCK depends on the driver: not assumed."""
    check_host(PoolOptions(size=GiB), NO_CAP, runtime)
    check_host(PoolOptions(size=GiB), dataclasses.replace(GPU_HOST, cap_ipc_lock=False, memlock_soft=0), "auto")


def test_memlock_counts_every_buffer_in_whole_pages_and_a_tensors_extra_page() -> None:
    layout = layouts.PagedBytes("layer_first", 4, 1000)  # four buffers, 1000 B per page each
    host = dataclasses.replace(NO_CAP, locked_bytes=0, memlock_soft=24 * KiB)
    check_host(PoolOptions(size=4 * 4000, layout=layout), host, "mlock")  # 4 pages: 4 buffers of 4000 B
    message = refusal(PoolOptions(size=5 * 4000, layout=layout), host)  # 19.5 KiB in 4 buffers of 5000 B
    assert message.startswith("size=20000 B = 19.53 KiB needs 32 KiB locked with mlock")  # 2 pages each
    check_host(PoolOptions(size=20 * KiB), host, "mlock", new_memory=False)
    message = refusal(PoolOptions(size=24 * KiB), host, new_memory=False)
    assert message.startswith("pin(tensor) of 24576 B = 24 KiB needs 28 KiB locked")  # it may start mid-page


# -- which runtimes pin for real ---------------------------------------------------------------------------------


def test_pinning_capabilities() -> None:
    """Names resolve to their runtime's declared capabilities (from the class, nothing is built);
    "auto" by the host's GPU stack; objects declare their own."""

    def pinning(runtime: object, host: HostFacts = HOST) -> tuple[bool, bool] | None:
        caps = pinning_capabilities(runtime, host)
        return None if caps is None else (caps.resident, caps.charges_memlock)

    assert pinning(None) is None
    assert pinning("nope") is None  # resolving it raises the ConfigError
    assert pinning(FakeRuntime()) == pinning(FakeRuntime(lock_on_fault=True)) == (False, False)
    assert pinning("mlock") == pinning(MlockRuntime(), GPU_HOST) == (True, True)
    assert pinning("cuda") == pinning("rocm") == (True, False)
    assert pinning("auto") == (True, True)  # no GPU stack: mlock
    assert pinning("auto", GPU_HOST) == (True, False)
    assert pinning("auto", dataclasses.replace(HOST, torch_hip="6.2", amd_kfd=True)) == (True, False)
    assert pinning("auto", dataclasses.replace(HOST, torch_cuda="12.4")) == (True, True)  # no driver: mlock

    class Custom:
        name = "custom"

        def register(self, ptr: int, nbytes: int) -> None: ...

        def unregister(self, ptr: int) -> None: ...

    assert pinning(Custom()) == (True, False)  # declares nothing: a runtime pins for real


class PageCharger:
    """A runtime pinpool has never heard of, named like none of its own, that declares its
    registrations charged to RLIMIT_MEMLOCK."""

    name = "page-charger"
    capabilities = Capabilities(charges_memlock=True)

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class Phantom(PageCharger):
    """Declares it touches no memory (as FakeRuntime does): nothing to charge."""

    name = "phantom"
    capabilities = Capabilities(resident=False, charges_memlock=True)


def test_a_new_runtime_gets_the_preflight_it_declares() -> None:
    """The pre-flight follows declared capabilities, never a runtime's name or class."""
    assert refusal(PoolOptions(size=GiB), NO_CAP, PageCharger()).startswith("size=1073741824 B = 1 GiB needs 1 GiB")
    assert "cannot be pinned here" in refusal(PoolOptions(size=4 * GiB), CONTAINER, PageCharger())
    check_host(PoolOptions(size=GiB), NO_CAP, Recorder())  # declares nothing: memory only, no memlock
    check_host(PoolOptions(size=64 * GiB), CONTAINER, Phantom())  # not resident: nothing charged
    check_host(PoolOptions(size=GiB), NO_CAP, Phantom())
    # Its Capabilities work in place of the runtime, as the pool passes them.
    assert "RLIMIT_MEMLOCK leaves only" in refusal(PoolOptions(size=GiB), NO_CAP, Capabilities(charges_memlock=True))


# -- through PinnedPool and pin(): their construction passes the runtime ----------------------------------------


class Recorder:
    """A runtime object that pins nothing (so the probe below is harmless) but is not FakeRuntime,
    so the pre-flight treats it as pinning for real."""

    name = "recorder"

    def register(self, ptr: int, nbytes: int) -> None:
        pass

    def unregister(self, ptr: int) -> None:
        pass


def _preflight_wired() -> bool:
    """Whether PinnedPool runs the memory pre-flight, at construction or on entry (before mapping)."""
    tiny = dataclasses.replace(_probe.probe_host(), mem_available=MiB, cgroup_memory_limit=None)
    with mock.patch.object(_probe, "probe_host", return_value=tiny):
        try:
            with pinpool.PinnedPool(size=64 * MiB, runtime=Recorder(), populate=False, registry=None):
                pass
        except ConfigError as error:
            return "cannot be pinned here" in str(error)
    return False


WIRED = _preflight_wired()
needs_wiring = pytest.mark.skipif(
    not WIRED,
    reason="PinnedPool does not run the memory pre-flight yet: pinpool/_pool/pool.py must call "
    "check_host(options, _probe.probe_host(), runtime, new_memory=source is None) before it maps (see the report)",
)


_MEMORY_FIELDS = [
    f.name
    for f in dataclasses.fields(HostFacts)
    if f.name.startswith("cgroup_") or f.name in ("mem_available", "memlock_soft", "cap_ipc_lock")
]


@needs_wiring
@pytest.mark.parametrize("runtime", ["mlock", "auto"])
def test_pinned_pool_refuses_before_anything_is_mapped(runtime: str) -> None:
    host = dataclasses.replace(_probe.probe_host(), **{name: getattr(CONTAINER, name) for name in _MEMORY_FIELDS})
    with mock.patch.object(_probe, "probe_host", return_value=host), mock.patch.object(_libc, "mmap_anonymous") as mmap:
        with pytest.raises(ConfigError, match=r"size=4294967296 B = 4 GiB cannot be pinned here"):
            with pinpool.PinnedPool(size="4GiB", runtime=runtime, registry=None):
                pytest.fail("the body must not run")
    mmap.assert_not_called()


@needs_wiring
def test_pin_checks_the_memlock_budget_but_not_residency() -> None:
    tensor = torch.empty(MiB, dtype=torch.uint8)
    host = dataclasses.replace(_probe.probe_host(), mem_available=4096, cgroup_memory_limit=None)
    with mock.patch.object(_probe, "probe_host", return_value=host):
        with pinpool.pin(tensor, runtime=Recorder(), registry=None):
            pass  # the tensor exists already: not charged again
    host = dataclasses.replace(host, cap_ipc_lock=False, memlock_soft=64 * KiB, locked_bytes=0)
    with mock.patch.object(_probe, "probe_host", return_value=host):
        with pytest.raises(ConfigError, match=r"^pin\(tensor\) of 1048576 B = 1 MiB needs 1 MiB locked with mlock"):
            with pinpool.pin(tensor, runtime="mlock", registry=None):
                pytest.fail("the body must not run")


def test_fake_pools_beyond_this_host_still_plan(fake: FakeRuntime) -> None:
    pinpool.PinnedPool(size="100TiB", chunk_bytes="1TiB", runtime=fake, registry=None)


# -- what cannot be known in advance: ENOMEM / EAGAIN while pinning are PinErrors, rolled back ---------------------


def test_fake_enomem_in_populate_is_a_pin_error_with_full_rollback() -> None:
    fake = FakeRuntime(fail_populate_on=3)
    pool = pinpool.PinnedPool(size=64 * MiB, chunk_bytes=16 * MiB, runtime=fake, registry=None, max_retries=0)
    with pytest.raises(pinpool.PinError) as info:
        with pool:
            pytest.fail("the body must not run")
    error = info.value
    assert (error.reason, error.code, error.phase) == ("ENOMEM", errno.ENOMEM, "populate")
    assert "rc=12 (ENOMEM)" in str(error) and "every registered chunk was rolled back" in str(error)
    assert fake.registered == {} and error.leaked == ()


@pytest.fixture
def vmlck() -> int:
    gc.collect()
    return locked_bytes()


def _enter(pool: pinpool.PinnedPool) -> pinpool.PinError:
    with pytest.raises(pinpool.PinError) as info:
        with pool:
            pytest.fail("the body must not run")
    return info.value


@needs_mlock
def test_enomem_from_populate_names_memory_and_rolls_back(monkeypatch: pytest.MonkeyPatch, vmlck: int) -> None:
    """The kernel runs out of memory faulting a span: a PinError that says so, every lock undone."""
    real = _libc.madvise
    calls = []

    def madvise(address: int, length: int, advice: int) -> int:
        if advice == _libc.MADV_POPULATE_WRITE:
            calls.append(length)
            if len(calls) == 3:
                return errno.ENOMEM
        return real(address, length, advice)

    monkeypatch.setattr(_libc, "madvise", madvise)
    runtime = MlockRuntime()
    pool = pinpool.PinnedPool(
        size=64 * MiB, chunk_bytes=16 * MiB, runtime=runtime, populate=True, registry=None, max_retries=0
    )
    error = _enter(pool)
    assert (error.reason, error.phase) == ("ENOMEM", "populate")
    assert "the kernel could not fault in" in str(error) and "the host is probably short of memory" in str(error)
    assert runtime.registered == {} and locked_bytes() == vmlck


@needs_mlock
@pytest.mark.parametrize(
    ("err", "says"),
    [
        (errno.ENOMEM, "the host is short of memory: make the pool smaller or free memory"),
        (errno.EAGAIN, "could not be locked"),
    ],
)
@pytest.mark.parametrize("populate", [True, False])
def test_enomem_and_eagain_from_mlock_roll_back(
    monkeypatch: pytest.MonkeyPatch, vmlck: int, err: int, says: str, populate: bool
) -> None:
    """mlock fails part-way (after other chunks really locked): a PinError naming the cause, no lock left."""
    monkeypatch.setattr(_libc, "has_cap_ipc_lock", lambda: True)  # the message for "the limit allows it"
    calls = []
    for name in ("mlock", "mlock_on_fault"):
        real = getattr(_libc, name)

        def lock(address: int, length: int, real: object = real) -> int:
            calls.append(length)
            return err if len(calls) == 2 else real(address, length)  # type: ignore[operator]

        monkeypatch.setattr(_libc, name, lock)
    runtime = MlockRuntime()
    pool = pinpool.PinnedPool(
        size=64 * MiB, chunk_bytes=16 * MiB, runtime=runtime, populate=populate, register_workers=1,
        registry=None, max_retries=0,
    )  # fmt: skip
    error = _enter(pool)
    assert (error.reason, error.phase, error.code) == (errno.errorcode[err], "register", err)
    assert says in str(error) and "every registered chunk was rolled back" in str(error)
    assert runtime.registered == {} and locked_bytes() == vmlck


# -- a real memory cgroup ---------------------------------------------------------------------------------------

CGROUP_ROOT = Path("/sys/fs/cgroup")
LIMIT = 2 * GiB

CHILD = textwrap.dedent(
    """
    import json, sys
    import pinpool
    from pinpool._host import libc as _libc

    size = int(sys.argv[1])
    out = {"cgroup": open("/proc/self/cgroup").read()}
    try:
        with pinpool.PinnedPool(size=size, runtime="mlock", registry=None) as pool:
            out["pinned"] = pool.pinned_bytes
            out["vmlck_during"] = _libc.vm_locked_bytes()
    except pinpool.ConfigError as error:
        out["error"] = str(error)
    out["vmlck_after"] = _libc.vm_locked_bytes()
    print(json.dumps(out))
    """
)


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[tuple[Path, int]]:
    """A new memory cgroup limited to ``limit`` bytes: (its cgroup.procs, the cgroup version).

    cgroup v2 at /sys/fs/cgroup (the memory controller enabled in the root's subtree_control), else
    the v1 memory hierarchy at /sys/fs/cgroup/memory. Skips, saying why, where the machine does not
    allow it. Removed afterwards."""
    name = f"pinpool-test-{os.getpid()}"
    controllers = CGROUP_ROOT / "cgroup.controllers"
    if controllers.exists():
        if "memory" not in controllers.read_text().split():
            pytest.skip(
                f"cgroup v2 at {CGROUP_ROOT} has no memory controller ({controllers}: {controllers.read_text()!r})"
            )
        parent, version = CGROUP_ROOT, 2
    elif (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists():
        parent, version = CGROUP_ROOT / "memory", 1
    else:
        pytest.skip(f"no memory cgroup hierarchy at {CGROUP_ROOT} (neither v2 with memory nor v1 memory/)")
    group = parent / name
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"cannot create a cgroup under {parent}: {error} (read-only cgroupfs, or not root)")
    try:
        try:
            if version == 2:
                if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                    _write(parent / "cgroup.subtree_control", "+memory")
                _write(group / "memory.max", str(limit))
                if (group / "memory.swap.max").exists():
                    _write(group / "memory.swap.max", "0")  # no swapping the rest of the process out to make room
            else:
                _write(group / "memory.limit_in_bytes", str(limit))
                if (group / "memory.memsw.limit_in_bytes").exists():
                    _write(group / "memory.memsw.limit_in_bytes", str(limit))
        except OSError as error:
            pytest.skip(f"cannot set a memory limit on {group} (cgroup v{version}): {error} (nested-container limits?)")
        yield group / "cgroup.procs", version
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:  # the child's exit may still be settling
                time.sleep(0.1)


def run_in_cgroup(procs: Path, size: int) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    """Run CHILD in the cgroup: the shell moves itself in, then execs Python, so nothing runs outside it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = preloaded.run(
        ["sh", "-c", f'echo $$ > {procs} && exec "$0" -c "$1" "$2"', sys.executable, CHILD, str(size)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, (
        f"exit {done.returncode} (137 or -9: OOM-killed)\nstdout: {done.stdout}\nstderr: {done.stderr[-3000:]}"
    )
    return done, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cgroup() -> Iterator[tuple[Path, int]]:
    if os.geteuid() != 0:
        pytest.skip("creating a memory cgroup needs root")
    available = _probe.probe_host().memory_available
    if available is not None and available < LIMIT + GiB:
        pytest.skip(f"this machine has {available} B available, too little to fill a {LIMIT} B cgroup safely")
    if not _libc.has_cap_ipc_lock():
        pytest.skip("the child locks 512 MiB: needs CAP_IPC_LOCK (root normally has it)")
    with memory_cgroup(LIMIT) as group:
        yield group


@needs_wiring
def test_a_pool_twice_the_cgroup_is_a_config_error_not_an_oom_kill(cgroup: tuple[Path, int]) -> None:
    procs, version = cgroup
    _done, out = run_in_cgroup(procs, 4 * GiB)
    assert procs.parent.name in str(out["cgroup"])  # it ran inside the cgroup
    message = str(out["error"])
    assert message.startswith("size=4294967296 B = 4 GiB cannot be pinned here: it needs 4.01 GiB of memory")
    assert f"the memory cgroup /{procs.parent.name} (cgroup v{version}) has a limit of 2 GiB" in message
    assert "raise the container's memory limit" in message and "nothing has been mapped or pinned" in message
    assert out["vmlck_after"] == 0


@needs_wiring
def test_a_pool_that_fits_the_cgroup_pins(cgroup: tuple[Path, int]) -> None:
    procs, _version = cgroup
    _done, out = run_in_cgroup(procs, 512 * MiB)
    assert "error" not in out, out.get("error")
    assert out["pinned"] == 512 * MiB and out["vmlck_during"] == 512 * MiB and out["vmlck_after"] == 0
