"""``pinpool doctor``: is this host ready to pin a pool of a given size, and if not, what to change.
Facts are read once (:func:`read_facts`); every check is a pure function of them (the memory,
memlock, huge page and NUMA ones are the pool's own pre-flight checks, asked about ``--size``)."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .. import _probe
from .._errors import ConfigError
from .._plan import preflight
from .._plan.calls import duty_cycle
from .._plan.facts import HostFacts
from .._plan.preflight import FAIL, OK, SKIP, STATUSES, WARN, Check
from .._units import format_bytes
from ..runtimes._gpu import CudaFacts, read_cuda_facts
from .engines import TransferFacts, read_transfer_facts, transfer_checks
from .options import pool_options
from .progress import while_loading

if TYPE_CHECKING:
    from .._shared.format import HalfMade, RegionInfo


CHUNK_ENV = "PINPOOL_REGISTER_CHUNK_GB"  # the same as pinpool._plan.options.CHUNK_ENV (a test holds them equal)
KNOWN_ENV: Mapping[str, str] = {  # every variable pinpool reads (a test greps the package for PINPOOL_)
    CHUNK_ENV: "the upper bound of one registration call, in GiB; unset: 256",
    "PINPOOL_NODE_SLOTS": "how many processes on this host may pin at once; unset: no limit",
    "PINPOOL_NODE_BUDGET": "bytes all cooperating pools on this host may hold pinned (a size, a fraction "
    "or a percentage of MemTotal); unset: no budget",
    "PINPOOL_NODE_DIR": "the directory where processes on this host coordinate pinning; unset: /dev/shm/pinpool-<uid>",
}
# Linux 6.11 to 6.13 cap one pin_user_pages call, so one cudaHostRegister, at 2 GB.
CAPPED_KERNELS = ((6, 11), (6, 14))
KERNEL_PIN_CAP_BYTES = 2 * 10**9


@dataclass(frozen=True)
class DoctorFacts:
    """Everything the checks read: the host as pools see it, and what only the doctor asks."""

    host: HostFacts
    cuda: CudaFacts
    env: Mapping[str, str]
    regions: tuple[RegionInfo, ...] = ()  # pinpool.SharedMemory regions in /dev/shm and hugetlbfs mounts
    half_made: tuple[HalfMade, ...] = ()  # regions' temporary files: being made now, or left by a dead creator
    transfer: TransferFacts = field(default_factory=TransferFacts)  # transfer engines (Mooncake, NIXL), RDMA devices


def check_cgroup(host: HostFacts) -> Check:
    """The memory cgroup that binds, as found (whether a pool fits it is the memory check's answer)."""
    version, limit, usage, reclaimable = (
        host.cgroup_version, host.cgroup_memory_limit, host.cgroup_memory_usage, host.cgroup_memory_reclaimable,
    )  # fmt: skip
    if version is None:
        return Check("cgroup", OK, "no memory cgroup found: no container memory limit applies")
    where = f"memory cgroup {host.cgroup_path or '/'} (v{version})"
    room = host.cgroup_room
    if limit is None or room is None:
        return Check("cgroup", OK, f"{where} has no limit")
    cache = f", {format_bytes(reclaimable)} of it reclaimable page cache" if reclaimable else ""
    used = "usage unknown" if usage is None else f"usage {format_bytes(usage)}{cache}"
    return Check("cgroup", OK, f"{where}: limit {format_bytes(limit)}, {used}, room {format_bytes(room)}")


def check_cpu(host: HostFacts) -> Check:
    """The CPU budget worker counts derive from, and the pin threads a large pool starts on it by default."""
    from .._plan.plan import default_populate_workers, pool_cpus  # torch: only once the doctor runs

    quota = host.cpu_quota
    cpus = None if quota is None else quota.cpus
    limit = "no CPU quota" if quota is None or cpus is None else (
        f"quota {cpus:.2f} CPUs ({quota.quota_us}/{quota.period_us} us per period, {quota.source} of {quota.path})"
    )  # fmt: skip
    budget = host.cpu_budget
    uses = [default_populate_workers(pool_cpus(budget, background=bg)) for bg in (False, True)]
    duty = duty_cycle(cpus, background=True)
    rests = f" busy {duty:.0%} of the time (the quota leaves no whole CPU)" if duty < 1 else ""
    detail = (
        f"affinity {host.cpus} CPUs, {limit}: budget {budget}; default populate workers: up to {uses[0]} "
        f"for a pool, {uses[1]} for a background pool{rests}"
    )
    if quota is not None and quota.ignored:
        return Check(
            "cpu", WARN, f"{detail}; ignored as unreadable: {'; '.join(quota.ignored)}",
            "check the cgroup's CPU quota files (the kernel writes only numbers there); to size pinning yourself, "
            "give populate_workers= and register_workers=",
        )  # fmt: skip
    return Check("cpu", OK, detail)


def check_kernel(release: str, populate_write: bool, chunk_limit: int | None) -> Check:
    """6.11–6.13 cap one pin call at 2 GB; before 5.14 no MADV_POPULATE_WRITE (``chunk_limit`` None: invalid)."""
    match = re.match(r"(\d+)\.(\d+)", release)
    version = None if match is None else (int(match.group(1)), int(match.group(2)))
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
    return Check("kernel", WARN, detail, problems[0][1]) if problems else Check("kernel", OK, detail)


def check_cuda(facts: CudaFacts) -> Check:
    """The GPU torch sees, its driver, and whether it can use registered memory by its host pointer."""
    if facts.skip_reason is not None:
        return Check("cuda", SKIP, facts.skip_reason)
    if facts.error is not None:
        return Check(
            "cuda", FAIL, f"torch sees a GPU but asking about it failed: {facts.error}",
            "check nvidia-smi (or rocm-smi) in the same environment, and the device nodes in the container",
        )  # fmt: skip
    cuda = f" (CUDA {facts.driver_cuda})" if facts.driver_cuda else ""
    driver = f"driver {facts.driver_version or 'unknown'}{cuda}"
    build = (
        f"torch {facts.torch_version or '?'} built for {'HIP' if facts.build == 'rocm' else 'CUDA'} {facts.torch_cuda}"
    )
    devices = "; ".join(f"{d.index}: {d.name}" for d in facts.devices) or "none"
    found = f"{len(facts.devices)} device(s) [{devices}], {driver}, {build}"
    if facts.build == "rocm":
        return Check("cuda", OK, f"{found} (CanUseHostPointerForRegisteredMem is not read on ROCm)")
    unknown = [d.index for d in facts.devices if d.can_use_host_pointer is None]
    if cannot := [d.index for d in facts.devices if d.can_use_host_pointer == 0]:
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


def _chunk_limit(value: str) -> int:  # as the pool reads it
    from .._plan.options import chunk_limit_from_env  # torch: imported only when the variable is set

    return chunk_limit_from_env({CHUNK_ENV: value})


def env_value(name: str, value: str) -> str:
    """What ``name=value`` means to pinpool, read by the code that reads it; ConfigError when invalid."""
    if name == CHUNK_ENV:
        return format_bytes(_chunk_limit(value))
    from .._node.config import NodePacing  # node pacing reads the PINPOOL_NODE_ variables, each checked alone here

    pacing = NodePacing.from_options(environ={name: value})
    if pacing is not None and pacing.slots is not None:
        return f"{pacing.slots} at once"
    if pacing is not None and pacing.budget_bytes is not None:
        return format_bytes(pacing.budget_bytes)
    return repr(value)


def env_chunk_limit(env: Mapping[str, str]) -> int | None:
    """pinpool's per-call limit under ``env``: the variable, else 256 GiB; None when it is invalid."""
    if (value := env.get(CHUNK_ENV)) is None:
        return 256 << 30
    try:
        return _chunk_limit(value)
    except ConfigError:
        return None


def check_env(env: Mapping[str, str]) -> list[Check]:
    """One check per pinpool variable set, one for the unset ones, one per unknown PINPOOL_ (a typo?)."""
    checks: list[Check] = []
    if unset := [name for name in KNOWN_ENV if name not in env]:
        checks.append(Check("env", OK, f"unset (defaults apply): {', '.join(unset)}"))
    for name, meaning in KNOWN_ENV.items():
        if (value := env.get(name)) is None:
            continue
        try:
            checks.append(Check(f"env {name}", OK, f"{name}={value!r}: {env_value(name, value)} ({meaning})"))
        except ConfigError as exc:
            checks.append(Check(f"env {name}", FAIL, str(exc), f"fix or unset {name} ({meaning})"))
    known = ", ".join(KNOWN_ENV)
    checks.extend(
        Check(f"env {name}", WARN, f"{name} is set but pinpool reads no such variable (known: {known})",
              f"unset {name}, or correct its name")
        for name in sorted(env) if name.startswith("PINPOOL_") and name not in KNOWN_ENV
    )  # fmt: skip
    return checks


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "at an unknown time"
    for unit, length in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= length:
            return f"{seconds / length:.1f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _shown(path: str) -> str:
    return path if path.isprintable() else ascii(path)  # a file name reaches a terminal


def check_region(region: RegionInfo) -> Check:
    """One pinpool shared memory region, what it holds and who made it; one left behind warns."""
    record = region.record  # its text is printable ASCII (the trailer's parser refuses anything else)
    path = _shown(region.path)
    layout = f", layout {record['layout']}" if "layout" in record else ""
    pages = f", {record['num_pages']} pages" if "num_pages" in record else ""
    if region.created_pid is None:
        creator = "by an unknown process (its trailer names no valid pid)"
    else:
        state = {True: "running", False: "gone", None: f"on host {region.created_host!r}"}[region.creator_alive]
        creator = f"by pid {region.created_pid} ({state})"
    detail = (
        f"{path}: {format_bytes(region.nbytes)} region{layout}{pages}, {format_bytes(region.held_bytes)} held "
        f"in memory ({format_bytes(region.page_size)} pages), owner uid {region.owner_uid}, created {creator} "
        f"{_age(region.age_seconds)}, region id {region.region_id}, generation {region.generation}, "
        f"{'kept' if region.keep else 'not kept'}"
    )
    if region.suspect_pages:  # write intents a dead writer left: its successor drops those pages
        runs = ", ".join(f"[{r.start}, {r.stop})" for r in region.suspect_pages[:3])
        more = f" and {len(region.suspect_pages) - 3} more" if len(region.suspect_pages) > 3 else ""
        detail += f", pages {runs}{more} suspect (a writer died writing them: SharedMemory.suspect_pages())"
    remove = f"rm {path} once no process maps it (its memory returns when the last process mapping it exits)"
    if region.orphaned:  # its creator is gone and no process maps it; its trailer was read back whole
        orphan = (
            f"{detail}: orphaned, re-attachable (its creator is gone and no process maps it; attach with "
            f"SharedMemory({path!r}, create=False), bytes as the creator left them)"
        )
        if region.keep:
            return Check("region", OK, orphan, f"when no longer needed: {remove}")
        return Check(
            "region", WARN, f"{orphan}; not kept: left behind by a process that ended without removing it",
            f"re-attach it with SharedMemory({path!r}, create=False, adopt=True) (that process removes it when it "
            f"lets go, unless kept), or remove it: pinpool doctor --remove-stale, or {remove}",
        )  # fmt: skip
    if region.creator_alive is False and region.in_use:
        detail += ", re-attached: in use by a running process"
    elif region.creator_alive is False and not region.keep:
        return Check(
            "region", WARN, f"{detail}: left behind by a process that ended without removing it", f"remove it: {remove}"
        )  # fmt: skip
    return Check("region", OK, detail, f"when no longer needed: {remove}")


def check_half_made(half: HalfMade) -> Check:
    """A region's temporary file: a warning once its creator died."""
    path = _shown(half.path)
    if half.in_progress:
        return Check("region", OK, f"{path}: a region being created now", "")
    return Check(
        "region", WARN,
        f"{path}: a region left half-made by a creator that died while creating it, "
        f"{format_bytes(half.held_bytes)} held in memory",
        "remove it: pinpool doctor --remove-stale, or rm it (the next creation of a region in its directory "
        "removes it too)",
    )  # fmt: skip


def check_removed(path: str, held_bytes: int, *, orphan: bool = False) -> Check:  # --remove-stale removed it
    what = (
        "an orphaned region, not kept, that no process mapped" if orphan
        else "a region left half-made by a creator that died while creating it"
    )  # fmt: skip
    return Check("region", OK, f"{_shown(path)}: removed, {what} ({format_bytes(held_bytes)} of memory freed)")


def run_checks(facts: DoctorFacts, size: int | None) -> list[Check]:
    """Every check, in print order; the pre-flight's asked about ``size`` bytes of new memory in pages."""
    host = facts.host
    nbytes = None if size is None else -(-size // host.page_size) * host.page_size
    subject = "" if size is None else f"--size {format_bytes(size)}"
    return [
        preflight.memlock_check(nbytes, host, subject=subject),
        preflight.memory_check(nbytes, host, subject=subject),
        check_cgroup(host),
        check_cpu(host),
        preflight.thp_check(host.thp_mode, wanted=False, defrag=host.thp_defrag),
        preflight.hugetlb_check(size, free=host.hugetlb_free, total=host.hugetlb_total,
                                huge_page_size=host.huge_page_size, wanted=False),
        preflight.hugetlb_check(size, free=host.hugetlb_1g_free, total=host.hugetlb_1g_total, huge_page_size=1 << 30,
                                wanted=False),
        check_kernel(host.kernel_release, host.populate_write, env_chunk_limit(facts.env)),
        preflight.numa_check(None, host.numa_nodes),
        check_cuda(facts.cuda),
        *transfer_checks(facts.transfer, host, size),
        *check_env(facts.env),
        *(check_region(region) for region in facts.regions),
        *(check_half_made(half) for half in facts.half_made),
    ]  # fmt: skip


def exit_code(checks: Sequence[Check]) -> int:  # warnings do not fail
    return 1 if any(c.status == FAIL for c in checks) else 0


def counts(checks: Sequence[Check]) -> dict[str, int]:
    return {status: sum(c.status == status for c in checks) for status in STATUSES}


def render_text(checks: Sequence[Check], size: int | None) -> str:
    width = min(8, max(len(c.name) for c in checks))  # a longer name (a variable's) pushes only its line
    lines = [f"pinpool doctor{f' for --size {format_bytes(size)}' if size is not None else ''}:"]
    for check in checks:
        lines.append(f"  {check.status:<4}  {check.name:<{width}}  {check.detail}")
        if check.fix and check.status != OK:
            lines.append(f"        {'':<{width}}  fix: {check.fix}")
    tally = counts(checks)
    lines.append("result: " + ", ".join(f"{tally[s]} {s}" for s in STATUSES))
    return "\n".join(lines)


def to_json(checks: Sequence[Check], size: int | None, version: str) -> dict[str, Any]:
    return {"pinpool": version, "size_bytes": size, "ok": exit_code(checks) == 0, "counts": counts(checks),
            "checks": [asdict(c) for c in checks]}  # fmt: skip


def read_facts(*, cuda: bool = True, region_dirs: Sequence[str] | None = None, engines: bool = True) -> DoctorFacts:
    """This host's facts now. ``cuda=False`` skips the GPU probe (and the torch import); ``region_dirs``:
    where to look for shared regions (None: every tmpfs and hugetlbfs mount); ``engines=False`` skips
    importing the transfer engines (in child interpreters) and reading the RDMA devices."""
    from .._shared.format import find_half_made, find_regions
    from .._shared.intents import suspects_in

    return DoctorFacts(
        host=_probe.probe_host(torch_build=cuda),
        cuda=read_cuda_facts() if cuda else CudaFacts(skip_reason="not probed (--no-cuda)"),
        env={k: v for k, v in os.environ.items() if k.startswith("PINPOOL_")},
        regions=tuple(find_regions(region_dirs, suspects=suspects_in)),
        half_made=tuple(find_half_made(region_dirs)),
        transfer=read_transfer_facts(probe=engines),
    )


def run_doctor(args: argparse.Namespace) -> int:
    size = pool_options(args, "doctor").get("size")
    removed: list[Check] = []
    if args.remove_stale:
        from .._shared.files import remove_half_made, remove_orphans

        removed = [check_removed(*each) for each in remove_half_made(args.region_dirs)]
        removed += [check_removed(*each, orphan=True) for each in remove_orphans(args.region_dirs)]
    with while_loading("reading this host" + (" (loading torch to ask about GPUs)" if args.cuda else "")):
        facts = read_facts(cuda=args.cuda, region_dirs=args.region_dirs, engines=args.engines)
        checks = run_checks(facts, size) + removed
    if args.json:
        from .. import __version__

        print(json.dumps(to_json(checks, size, __version__)))
    else:
        print(render_text(checks, size))
    return exit_code(checks)
