"""``pinpool doctor``: is this host ready to pin a pool of a given size, and if not, what to change.

Facts are read once, in :func:`read_facts`, into a :class:`DoctorFacts` value; every check is a
pure function of facts (and the requested size) that returns a :class:`Check` with a status
(``ok``, ``warn``, ``fail`` or ``skip``), what it found, and a one-line fix. So each rule is
tested with hand-made facts, and one test runs the whole thing on the real host.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from . import _libc
from ._errors import ConfigError
from ._memlimits import cgroup_room, read_memory_limits
from ._shared import RegionInfo, find_regions
from ._units import format_bytes

__all__ = [
    "Check",
    "CudaDevice",
    "CudaFacts",
    "DoctorFacts",
    "check_region",
    "exit_code",
    "read_facts",
    "render_text",
    "run_checks",
    "to_json",
]

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
STATUSES = (OK, WARN, FAIL, SKIP)

THP = "/sys/kernel/mm/transparent_hugepage"
CHUNK_ENV = "PINPOOL_REGISTER_CHUNK_GB"  # the same name as pinpool._plan.CHUNK_ENV (a test holds them equal)
# Every environment variable pinpool reads, with what it means (a test greps the package for
# PINPOOL_, so a new one cannot be forgotten here). Each is checked by the code that reads it.
KNOWN_ENV: Mapping[str, str] = {
    CHUNK_ENV: "the upper bound of one registration call, in GiB; unset: 256",
    "PINPOOL_NODE_SLOTS": "how many processes on this host may pin at once; unset: no limit",
    "PINPOOL_NODE_BUDGET": "bytes all cooperating pools on this host may hold pinned (a size, a fraction "
    "or a percentage of MemTotal); unset: no budget",
    "PINPOOL_NODE_DIR": "the directory where processes on this host coordinate pinning; unset: /dev/shm/pinpool-<uid>",
}
# Linux 6.11 to 6.13 cap one pin_user_pages call, so one cudaHostRegister, at 2 GB.
CAPPED_KERNELS = ((6, 11), (6, 14))
KERNEL_PIN_CAP_BYTES = 2 * 10**9
# cudaDevAttrCanUseHostPointerForRegisteredMem, the same number in the driver API.
CAN_USE_HOST_POINTER_ATTR = 91
# Less than this share of the available memory left over is a warning: the server needs some too.
HEADROOM = 0.10


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``status`` is ok / warn / fail / skip; ``fix`` is empty when ok."""

    name: str
    status: str
    detail: str
    fix: str = ""


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


@dataclass(frozen=True)
class DoctorFacts:
    """Everything the checks read. Sizes in bytes; ``None`` means unlimited (limits) or unknown."""

    memlock_soft: int | None
    memlock_hard: int | None
    cap_ipc_lock: bool
    mem_available: int | None
    cgroup_version: int | None
    cgroup_limit: int | None
    cgroup_usage: int | None
    cgroup_reclaimable: int | None  # the cgroup's page cache: counted in usage, reclaimed before an OOM kill
    cgroup_path: str | None
    thp_enabled: str | None
    thp_defrag: str | None
    hugetlb_free: int
    hugetlb_total: int
    huge_page_size: int
    kernel_release: str
    populate_write: bool
    numa_nodes: tuple[int, ...]
    cuda: CudaFacts
    env: Mapping[str, str]
    # pinpool's shared memory regions in /dev/shm and hugetlbfs mounts (pinpool.SharedMemory)
    regions: tuple[RegionInfo, ...] = ()


# -- the checks: pure functions of facts ---------------------------------------------------------

_RAISE_MEMLOCK = (
    "raise the hard limit (systemd LimitMEMLOCK=infinity; docker --ulimit memlock=-1:-1; "
    "/etc/security/limits.conf 'memlock unlimited') or grant CAP_IPC_LOCK"
)


def _limit_text(value: int | None) -> str:
    return "unlimited" if value is None else format_bytes(value)


def check_memlock(soft: int | None, hard: int | None, cap_ipc_lock: bool, size: int | None) -> Check:
    """RLIMIT_MEMLOCK caps what mlock may lock, unless the process has CAP_IPC_LOCK."""
    limits = f"RLIMIT_MEMLOCK soft {_limit_text(soft)}, hard {_limit_text(hard)}"
    if cap_ipc_lock:
        return Check("memlock", OK, f"CAP_IPC_LOCK is set, so the limit does not apply ({limits})")
    if soft is None:
        return Check("memlock", OK, f"{limits}, no CAP_IPC_LOCK needed")
    fix = (
        "raise the soft limit in the shell that starts the server: ulimit -l unlimited (the hard limit allows it)"
        if hard is None or (size is not None and hard >= size)
        else _RAISE_MEMLOCK
    )
    if size is not None and soft < size:
        return Check(
            "memlock", FAIL,
            f"{limits} is below --size {format_bytes(size)} and CAP_IPC_LOCK is not set: "
            "mlock of the pool fails (CUDA registration may too)",
            fix,
        )  # fmt: skip
    if size is None:
        return Check(
            "memlock", WARN, f"{limits} without CAP_IPC_LOCK: pools larger than {format_bytes(soft)} cannot be locked",
            fix,
        )  # fmt: skip
    return Check("memlock", OK, f"{limits} covers --size {format_bytes(size)}")


def check_mem_available(size: int | None, mem_available: int | None) -> Check:
    """Pinned memory cannot be swapped or reclaimed: it must fit in what the host has free."""
    if mem_available is None:
        return Check("memory", WARN, "MemAvailable could not be read from /proc/meminfo", "check /proc is mounted")
    available = f"MemAvailable {format_bytes(mem_available)}"
    if size is None:
        return Check("memory", OK, available)
    if size > mem_available:
        return Check(
            "memory", FAIL,
            f"--size {format_bytes(size)} is more than {available}: pinned memory cannot be reclaimed or swapped, "
            "so the host would run out of memory while pinning",
            f"give a --size below {format_bytes(mem_available)} minus what the server itself needs, or free memory",
        )  # fmt: skip
    if mem_available - size < HEADROOM * mem_available:
        return Check(
            "memory", WARN,
            f"--size {format_bytes(size)} leaves {format_bytes(mem_available - size)} of {available}",
            "leave headroom for the server, the page cache and the kernel: a smaller --size",
        )  # fmt: skip
    return Check("memory", OK, f"{available} holds --size {format_bytes(size)}")


def check_cgroup(
    size: int | None,
    version: int | None,
    limit: int | None,
    usage: int | None,
    reclaimable: int | None = None,
    path: str | None = None,
) -> Check:
    """A container's memory limit counts pinned memory too: past it the container is OOM-killed.
    Its room is limit - usage + reclaimable page cache (pinpool._memlimits.cgroup_room)."""
    if version is None:
        return Check("cgroup", OK, "no memory cgroup found: no container memory limit applies")
    where = f"memory cgroup {path or '/'} (v{version})"
    if limit is None:
        return Check("cgroup", OK, f"{where} has no limit")
    room = cgroup_room(limit, usage, reclaimable)
    assert room is not None  # a limit always leaves a room
    cache = f", {format_bytes(reclaimable)} of it reclaimable page cache" if reclaimable else ""
    used = "usage unknown" if usage is None else f"usage {format_bytes(usage)}{cache}"
    found = f"{where}: limit {format_bytes(limit)}, {used}, room {format_bytes(room)}"
    if size is None:
        return Check("cgroup", OK, found)
    raise_it = (
        f"raise the container's memory limit (docker run --memory, Kubernetes resources.limits.memory) above "
        f"{format_bytes(size)} plus the server's own use, or give a smaller --size"
    )
    if size > room:
        return Check(
            "cgroup", FAIL, f"--size {format_bytes(size)} exceeds the room of the {found}: pinned pages cannot be "
            "reclaimed, so the process would be OOM-killed", raise_it,
        )  # fmt: skip
    if room - size < HEADROOM * room:
        return Check("cgroup", WARN, f"--size {format_bytes(size)} nearly fills the {found}", raise_it)
    return Check("cgroup", OK, f"{found}; --size {format_bytes(size)} fits")


def check_thp(enabled: str | None, defrag: str | None) -> Check:
    """--huge-pages thp needs THP in madvise or always mode; defrag 'always' with 'always' stalls every fault."""
    if enabled is None:
        return Check(
            "thp", WARN, f"transparent huge pages are not available ({THP} is missing): --huge-pages thp cannot work",
            "use --huge-pages hugetlb, or the default 4 KiB pages",
        )  # fmt: skip
    found = f"transparent huge pages: enabled [{enabled}], defrag [{defrag or 'unknown'}]"
    if enabled == "never":
        return Check(
            "thp", WARN, f"{found}: --huge-pages thp cannot work",
            f"echo madvise > {THP}/enabled (pinpool asks for huge pages with madvise)",
        )  # fmt: skip
    if enabled == "always" and defrag == "always":
        return Check(
            "thp", WARN, f"{found}: every anonymous page fault on the host may stall in direct compaction",
            f"echo defer+madvise > {THP}/defrag",
        )  # fmt: skip
    return Check("thp", OK, found)


def check_hugetlb(free: int, total: int, huge_page_size: int, size: int | None) -> Check:
    """--huge-pages hugetlb takes pages reserved in vm.nr_hugepages; only that option needs them."""
    page = format_bytes(huge_page_size)
    if total == 0:
        return Check("hugetlb", OK, f"no {page} hugetlb pages reserved (only --huge-pages hugetlb needs them)")
    found = f"{free} of {total} {page} hugetlb pages free ({format_bytes(free * huge_page_size)})"
    if size is not None:
        needed = -(-size // huge_page_size)
        if free < needed:
            return Check(
                "hugetlb", WARN, f"{found}: --huge-pages hugetlb would need {needed} for --size {format_bytes(size)}",
                f"echo {total - free + needed} > /proc/sys/vm/nr_hugepages, or use --huge-pages thp",
            )  # fmt: skip
    return Check("hugetlb", OK, found)


def kernel_version(release: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", release)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def check_kernel(release: str, populate_write: bool, chunk_limit: int | None) -> Check:
    """6.11–6.13 cap one pin call at 2 GB; before 5.14 there is no MADV_POPULATE_WRITE to pre-fault with.

    ``chunk_limit``: pinpool's per-call limit from the environment (None: the variable is invalid).
    """
    version = kernel_version(release)
    if version is None:
        return Check("kernel", WARN, f"cannot parse the kernel release {release!r}", "none needed if pins succeed")
    problems: list[tuple[str, str]] = []
    notes: list[str] = []
    low, high = CAPPED_KERNELS
    if low <= version < high:
        if chunk_limit is not None and chunk_limit <= KERNEL_PIN_CAP_BYTES:
            notes.append(
                f"this kernel caps one pin call at 2 GB; {CHUNK_ENV} keeps chunks at {format_bytes(chunk_limit)}"
            )
        else:
            limit = "unknown" if chunk_limit is None else format_bytes(chunk_limit)
            problems.append((
                f"Linux 6.11–6.13 cap one pin call (cudaHostRegister) at 2 GB; pinpool's chunk limit here is {limit}",
                f"export {CHUNK_ENV}=1 (or pass --chunk-bytes 1GiB), or run Linux 6.14 or newer",
            ))  # fmt: skip
    if not populate_write:
        problems.append((
            "no MADV_POPULATE_WRITE (Linux 5.14+): pages cannot be pre-faulted on threads, registration faults them",
            "run Linux 5.14 or newer for faster pinning",
        ))  # fmt: skip
    detail = "; ".join([f"Linux {release}", *notes, *(p for p, _ in problems)])
    if problems:
        return Check("kernel", WARN, detail, problems[0][1])
    return Check("kernel", OK, detail)


def check_numa(nodes: Sequence[int]) -> Check:
    listed = ", ".join(map(str, nodes))
    if len(nodes) <= 1:
        return Check("numa", OK, f"one NUMA node with memory ({listed})")
    return Check(
        "numa", OK, f"{len(nodes)} NUMA nodes with memory ({listed}): bind a pool near its GPU with --numa-node N"
    )


def check_cuda(facts: CudaFacts) -> Check:
    """The GPU torch sees, its driver, and whether it can use registered memory by its host pointer."""
    if facts.skip_reason is not None:
        return Check("cuda", SKIP, facts.skip_reason)
    if facts.error is not None:
        return Check(
            "cuda", FAIL, f"torch sees a GPU but asking about it failed: {facts.error}",
            "check nvidia-smi (or rocm-smi) in the same environment, and the device nodes in the container",
        )  # fmt: skip
    driver = f"driver {facts.driver_version or 'unknown'}" + (
        f" (CUDA {facts.driver_cuda})" if facts.driver_cuda else ""
    )
    build = (
        f"torch {facts.torch_version or '?'} built for {'HIP' if facts.build == 'rocm' else 'CUDA'} {facts.torch_cuda}"
    )
    devices = "; ".join(f"{d.index}: {d.name}" for d in facts.devices) or "none"
    found = f"{len(facts.devices)} device(s) [{devices}], {driver}, {build}"
    if facts.build == "rocm":
        return Check("cuda", OK, f"{found} (CanUseHostPointerForRegisteredMem is not read on ROCm)")
    unknown = [d.index for d in facts.devices if d.can_use_host_pointer is None]
    cannot = [d.index for d in facts.devices if d.can_use_host_pointer == 0]
    if cannot:
        return Check(
            "cuda", WARN,
            f"{found}; device(s) {cannot} cannot use registered memory by its host pointer "
            "(CanUseHostPointerForRegisteredMem=0)",
            "copies work as usual; kernels that read the pool directly need cudaHostGetDevicePointer",
        )  # fmt: skip
    if unknown:
        return Check(
            "cuda", WARN, f"{found}; CanUseHostPointerForRegisteredMem could not be read for device(s) {unknown}",
            "check that libcuda.so.1 (the driver library) can be loaded",
        )  # fmt: skip
    return Check("cuda", OK, f"{found}; CanUseHostPointerForRegisteredMem=1")


def _chunk_limit(value: str) -> int:
    """The bytes ``PINPOOL_REGISTER_CHUNK_GB=value`` means (ConfigError when invalid), as the pool reads it."""
    from ._plan import chunk_limit_from_env

    return chunk_limit_from_env({CHUNK_ENV: value})


def env_value(name: str, value: str) -> str:
    """What ``name=value`` means to pinpool, read by the code that reads it; ConfigError when invalid."""
    if name == CHUNK_ENV:
        return format_bytes(_chunk_limit(value))
    from ._node import NodePacing  # node pacing reads the PINPOOL_NODE_ variables, each checked alone here

    pacing = NodePacing.from_options(environ={name: value})
    if pacing is not None and pacing.slots is not None:
        return f"{pacing.slots} at once"
    if pacing is not None and pacing.budget_bytes is not None:
        return format_bytes(pacing.budget_bytes)
    return repr(value)


def env_chunk_limit(env: Mapping[str, str]) -> int | None:
    """pinpool's per-call limit under ``env``: the variable, else 256 GiB; None when it is invalid."""
    value = env.get(CHUNK_ENV)
    if value is None:
        return 256 << 30
    try:
        return _chunk_limit(value)
    except ConfigError:
        return None


def check_env(env: Mapping[str, str]) -> list[Check]:
    """One check per pinpool variable that is set, one for the unset ones, and one per unknown
    PINPOOL_ variable (a typo?)."""
    checks: list[Check] = []
    unset = [name for name in KNOWN_ENV if name not in env]
    if unset:
        checks.append(Check("env", OK, f"unset (defaults apply): {', '.join(unset)}"))
    for name, meaning in KNOWN_ENV.items():
        value = env.get(name)
        if value is None:
            continue
        try:
            means = env_value(name, value)
        except ConfigError as exc:
            checks.append(Check(f"env {name}", FAIL, str(exc), f"fix or unset {name} ({meaning})"))
            continue
        checks.append(Check(f"env {name}", OK, f"{name}={value!r}: {means} ({meaning})"))
    known = ", ".join(KNOWN_ENV)
    checks.extend(
        Check(
            f"env {name}",
            WARN,
            f"{name} is set but pinpool reads no such variable (known: {known})",
            f"unset {name}, or correct its name",
        )
        for name in sorted(env)
        if name.startswith("PINPOOL_") and name not in KNOWN_ENV
    )
    return checks


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "at an unknown time"
    for unit, length in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= length:
            return f"{seconds / length:.1f} {unit} ago"
    return f"{seconds:.0f} s ago"


def check_region(region: RegionInfo) -> Check:
    """One pinpool shared memory region: what it holds and who made it. Listing it is the point: a
    region kept for a warm restart, or left behind by a process that died, holds its memory until
    an operator removes it. Left behind (its creator is gone and did not mean to keep it): warn."""
    record = region.record
    layout = f", layout {record['layout']}" if "layout" in record else ""
    pages = f", {record['num_pages']} pages" if "num_pages" in record else ""
    if region.created_pid is None:
        creator = "by an unknown process"
    else:
        state = {True: "running", False: "gone", None: f"on host {region.created_host!r}"}[region.creator_alive]
        creator = f"by pid {region.created_pid} ({state})"
    detail = (
        f"{region.path}: {format_bytes(region.nbytes)} region{layout}{pages}, {format_bytes(region.held_bytes)} held "
        f"in memory ({format_bytes(region.page_size)} pages), owner uid {region.owner_uid}, created {creator} "
        f"{_age(region.age_seconds)}, generation {region.generation}, {'kept' if region.keep else 'not kept'}"
    )
    remove = f"rm {region.path} once no process maps it (its memory returns when the last process mapping it exits)"
    if region.creator_alive is False and not region.keep:
        return Check(
            "region", WARN, f"{detail}: left behind by a process that ended without removing it", f"remove it: {remove}"
        )  # fmt: skip
    return Check("region", OK, detail, f"when no longer needed: {remove}")


def run_checks(facts: DoctorFacts, size: int | None) -> list[Check]:
    """Every check, in the order they are printed."""
    return [
        check_memlock(facts.memlock_soft, facts.memlock_hard, facts.cap_ipc_lock, size),
        check_mem_available(size, facts.mem_available),
        check_cgroup(
            size,
            facts.cgroup_version,
            facts.cgroup_limit,
            facts.cgroup_usage,
            facts.cgroup_reclaimable,
            facts.cgroup_path,
        ),
        check_thp(facts.thp_enabled, facts.thp_defrag),
        check_hugetlb(facts.hugetlb_free, facts.hugetlb_total, facts.huge_page_size, size),
        check_kernel(facts.kernel_release, facts.populate_write, env_chunk_limit(facts.env)),
        check_numa(facts.numa_nodes),
        check_cuda(facts.cuda),
        *check_env(facts.env),
        *(check_region(region) for region in facts.regions),
    ]


def exit_code(checks: Sequence[Check]) -> int:
    """1 when any check failed, else 0 (warnings do not fail)."""
    return 1 if any(c.status == FAIL for c in checks) else 0


def counts(checks: Sequence[Check]) -> dict[str, int]:
    return {status: sum(c.status == status for c in checks) for status in STATUSES}


def render_text(checks: Sequence[Check], size: int | None) -> str:
    # Names up to 8 characters line up; a longer one (an environment variable) pushes only its line.
    width = min(8, max(len(c.name) for c in checks))
    lines = [f"pinpool doctor{f' for --size {format_bytes(size)}' if size is not None else ''}:"]
    for check in checks:
        lines.append(f"  {check.status:<4}  {check.name:<{width}}  {check.detail}")
        if check.fix and check.status != OK:
            lines.append(f"        {'':<{width}}  fix: {check.fix}")
    tally = counts(checks)
    lines.append("result: " + ", ".join(f"{tally[s]} {s}" for s in STATUSES))
    return "\n".join(lines)


def to_json(checks: Sequence[Check], size: int | None, version: str) -> dict[str, Any]:
    return {
        "pinpool": version,
        "size_bytes": size,
        "ok": exit_code(checks) == 0,
        "counts": counts(checks),
        "checks": [asdict(c) for c in checks],
    }


# -- reading the facts ----------------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _bracketed(text: str | None) -> str | None:
    """The selected value of a sysfs choice file: ``always [madvise] never`` -> ``madvise``."""
    if text is None:
        return None
    match = re.search(r"\[([^\]]+)\]", text)
    return match.group(1) if match else None


def _driver_version() -> str | None:
    text = _read("/proc/driver/nvidia/version") or ""
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else None


def _libcuda() -> Any | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib if lib.cuInit(0) == 0 else None


def _driver_cuda(lib: Any) -> str | None:
    version = ctypes.c_int()
    if lib is None or lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def _can_use_host_pointer(lib: Any, index: int) -> int | None:
    device, value = ctypes.c_int(), ctypes.c_int()
    if lib is None or lib.cuDeviceGet(ctypes.byref(device), index) != 0:
        return None
    if lib.cuDeviceGetAttribute(ctypes.byref(value), CAN_USE_HOST_POINTER_ATTR, device) != 0:
        return None
    return value.value


def read_cuda_facts() -> CudaFacts:
    """Ask torch (and the driver library) about GPUs, only when torch is importable and sees one."""
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
        lib = None if hip else _libcuda()
        devices = tuple(
            CudaDevice(i, torch.cuda.get_device_name(i), None if hip else _can_use_host_pointer(lib, i))
            for i in range(torch.cuda.device_count())
        )
        return CudaFacts(
            build="rocm" if hip else "cuda", torch_version=torch.__version__, torch_cuda=str(built),
            driver_version=_driver_version(), driver_cuda=None if hip else _driver_cuda(lib), devices=devices,
        )  # fmt: skip
    except Exception as exc:  # a broken driver is a finding, not a crash of the doctor
        return CudaFacts(error=f"{type(exc).__name__}: {exc}")


def read_facts(*, cuda: bool = True) -> DoctorFacts:
    """This host's facts now. ``cuda=False`` skips the GPU probe (and the torch import)."""
    soft, hard = _libc.memlock_limits()
    free, total = _libc.hugetlb_free_pages()
    memory = read_memory_limits()
    return DoctorFacts(
        memlock_soft=None if soft == _libc.RLIM_INFINITY else soft,
        memlock_hard=None if hard == _libc.RLIM_INFINITY else hard,
        cap_ipc_lock=_libc.has_cap_ipc_lock(),
        mem_available=memory.mem_available_bytes,
        cgroup_version=memory.cgroup_version,
        cgroup_limit=memory.cgroup_limit_bytes,
        cgroup_usage=memory.cgroup_usage_bytes,
        cgroup_reclaimable=memory.cgroup_reclaimable_bytes,
        cgroup_path=memory.cgroup_path,
        thp_enabled=_libc.transparent_huge_pages_mode(),
        thp_defrag=_bracketed(_read(f"{THP}/defrag")),
        hugetlb_free=free,
        hugetlb_total=total,
        huge_page_size=_libc.HUGE_PAGE_SIZE,
        kernel_release=os.uname().release,
        populate_write=_libc.populate_write_supported(),
        numa_nodes=_libc.numa_nodes(),
        cuda=read_cuda_facts() if cuda else CudaFacts(skip_reason="not probed (--no-cuda)"),
        env={k: v for k, v in os.environ.items() if k.startswith("PINPOOL_")},
        regions=tuple(find_regions()),
    )
