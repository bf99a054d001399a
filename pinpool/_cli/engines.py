"""``pinpool doctor``'s transfer engine checks: whether Mooncake's Transfer Engine and NIXL load here, and what
RDMA registration needs (``ibv_reg_mr`` pins pages against RLIMIT_MEMLOCK, up to each device's
``max_mr_size``). Read-only, and never in pinpool's own process: an engine's import loads native libraries
(and may crash or print), so each is tried in a child interpreter; the checks are pure functions of the facts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .._errors import RAISE_MEMLOCK
from .._plan.facts import HostFacts
from .._plan.preflight import FAIL, OK, SKIP, WARN, Check
from .._units import format_bytes

SYSFS_INFINIBAND = Path("/sys/class/infiniband")
PROBE_SECONDS = 120.0  # an engine's import may load torch and CUDA stubs: slow, but never forever


@dataclass(frozen=True)
class Engine:
    """A transfer engine pinpool has a registrar for: the module its registrar imports, the pip packages that
    ship it (the first is the one to install on a CPU host), and what it is."""

    check: str
    module: str
    packages: tuple[str, ...]
    what: str


ENGINES = (
    Engine("mooncake", "mooncake.engine", ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"),
           "Mooncake's Transfer Engine (MooncakeRegistrar)"),
    Engine("nixl", "nixl_cu12._api", ("nixl-cu12", "nixl"), "NIXL (NixlRegistrar)"),
)  # fmt: skip

# Debian/Ubuntu packages of the native libraries the engines' extensions link (Mooncake needs libibverbs even
# for TCP); a library not named here gets a generic fix.
DEBIAN_LIBRARIES = {
    "libibverbs.so.1": "libibverbs1", "librdmacm.so.1": "librdmacm1", "libnuma.so.1": "libnuma1",
    "libucp.so.0": "libucx0", "libucs.so.0": "libucx0", "libuct.so.0": "libucx0", "libefa.so.1": "libibverbs1",
    "libmlx5.so.1": "ibverbs-providers",
}  # fmt: skip
_MISSING_LIBRARY = re.compile(r"(lib[\w.+-]+?\.so(?:\.\d+)*): cannot open shared object file")


@dataclass(frozen=True)
class EngineFacts:
    """What importing one engine's module did: ``installed`` (its top package is there), ``error`` (the import's
    exception as ``Type: text``; None: it imports), ``version`` (``package version``, None when unknown)."""

    engine: Engine
    installed: bool
    error: str | None = None
    version: str | None = None


@dataclass(frozen=True)
class RdmaDevice:
    """One RDMA device of /sys/class/infiniband: its ports as (number, state, link layer), and ``max_mr_size``
    from ``ibv_query_device`` (None: unread, with ``error`` saying why)."""

    name: str
    ports: tuple[tuple[int, str, str], ...] = ()
    max_mr_size: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class TransferFacts:
    """The engines as imported (empty: not probed) and the RDMA devices (None: no /sys/class/infiniband)."""

    engines: tuple[EngineFacts, ...] = ()
    rdma: tuple[RdmaDevice, ...] | None = None
    skip_reason: str | None = "not probed"


# -- the checks: pure ---------------------------------------------------------------------------------------


def library_fix(error: str) -> str | None:
    """The install line for a native library an import could not load (``libibverbs.so.1`` -> libibverbs1)."""
    match = _MISSING_LIBRARY.search(error)
    if match is None:
        return None
    library = match.group(1)
    package = DEBIAN_LIBRARIES.get(library)
    if package is None:
        return f"install the system library that provides {library} (Debian/Ubuntu: apt-file search {library})"
    return f"apt-get install {package} (Debian/Ubuntu: it provides {library})"


def check_engine(facts: EngineFacts) -> Check:
    """Whether an engine's module imports here; the reason and the install line where it does not."""
    engine = facts.engine
    if not facts.installed:
        return Check(
            engine.check, SKIP, f"{engine.what}: {engine.module} is not installed",
            f"to use it: pip install {engine.packages[0]}",
        )  # fmt: skip
    version = f" ({facts.version})" if facts.version else ""
    if facts.error is None:
        return Check(engine.check, OK, f"{engine.what}: {engine.module} imports{version}")
    fix = library_fix(facts.error) or (
        f"reinstall it (pip install --force-reinstall {engine.packages[0]}) in this environment; the error names "
        "what is missing"
    )
    return Check(
        engine.check, WARN, f"{engine.what}: installed{version} but {engine.module} does not import: {facts.error}",
        fix,
    )  # fmt: skip


def _ports(device: RdmaDevice) -> str:
    return ", ".join(f"port {n} {state} {layer}".rstrip() for n, state, layer in device.ports) or "no ports"


def check_rdma(devices: tuple[RdmaDevice, ...] | None, size: int | None) -> Check:
    """The RDMA devices and their ``max_mr_size``: a registration larger than that fails, or was truncated
    (Mooncake#2017), so a registrar's ``limits.max_bytes`` must not exceed it."""
    if not devices:
        return Check("rdma", SKIP, "no RDMA devices (/sys/class/infiniband is empty or absent): TCP transport only")
    shown: list[str] = []
    problems: list[tuple[str, str]] = []
    for device in devices:
        mr = "max_mr_size unread" if device.max_mr_size is None else f"max_mr_size {format_bytes(device.max_mr_size)}"
        if device.error:
            mr += f" ({device.error})"
        shown.append(f"{device.name} ({_ports(device)}; {mr})")
        if device.ports and not any(state.upper().endswith("ACTIVE") for _n, state, _l in device.ports):
            problems.append((
                f"{device.name} has no active port",
                "check the link (ibstat, ibv_devinfo): an engine cannot reach a peer through a port that is down",
            ))  # fmt: skip
        if device.max_mr_size is not None and size is not None and size > device.max_mr_size:
            problems.append((
                f"--size {format_bytes(size)} is more than {device.name}'s max_mr_size: one registration of it "
                "fails",
                f"give the registrar limits.max_bytes <= {device.max_mr_size} (RegistrarLimits(max_bytes=...)); "
                "pinpool then plans registrations within it",
            ))  # fmt: skip
    detail = "; ".join(["RDMA devices: " + ", ".join(shown), *(p for p, _ in problems)])
    return Check("rdma", WARN, detail, problems[0][1]) if problems else Check("rdma", OK, detail)


def check_rdma_memlock(devices: tuple[RdmaDevice, ...] | None, host: HostFacts, size: int | None) -> Check:
    """``ibv_reg_mr`` pins the pages it registers against RLIMIT_MEMLOCK (the kernel's pinned_vm), beside
    anything mlock or CUDA holds: the limit must be unlimited, or cover the pool, unless CAP_IPC_LOCK."""
    name = "memlock:rdma"
    if not devices:
        return Check(name, SKIP, "no RDMA devices: TCP transports register without pinning pages")
    soft, hard = host.memlock_soft, host.memlock_hard
    limits = (
        f"RLIMIT_MEMLOCK soft {'unlimited' if soft is None else format_bytes(soft)}, "
        f"hard {'unlimited' if hard is None else format_bytes(hard)}"
    )
    if host.cap_ipc_lock:
        return Check(name, OK, f"CAP_IPC_LOCK is set: ibv_reg_mr is not limited ({limits})")
    if soft is None:
        return Check(name, OK, f"{limits}: ibv_reg_mr can pin a pool of any size")
    if size is None:
        return Check(
            name, WARN, f"{limits} without CAP_IPC_LOCK: ibv_reg_mr pins registered pages against it, so "
            f"registering more than {format_bytes(soft)} of pools with an RDMA engine fails", RAISE_MEMLOCK,
        )  # fmt: skip
    if size > soft:
        return Check(
            name, FAIL, f"--size {format_bytes(size)} registered over RDMA needs ibv_reg_mr to pin it, but "
            f"{limits} without CAP_IPC_LOCK: the engine's registration would fail part-way", RAISE_MEMLOCK,
        )  # fmt: skip
    return Check(name, OK, f"{limits} covers --size {format_bytes(size)} registered over RDMA")


def transfer_checks(facts: TransferFacts, host: HostFacts, size: int | None) -> list[Check]:
    """The engines' lines, then RDMA's; one skip line when nothing was probed (``--no-engines``)."""
    if facts.skip_reason is not None:
        return [Check("engines", SKIP, facts.skip_reason)]
    return [
        *(check_engine(engine) for engine in facts.engines),
        check_rdma(facts.rdma, size),
        check_rdma_memlock(facts.rdma, host, size),
    ]


# -- reading the facts: child interpreters and sysfs, nothing written ----------------------------------------

_IMPORT_PROBE = """
import importlib, importlib.metadata, importlib.util, json, sys
module, packages = sys.argv[1], sys.argv[2:]
found = {"installed": importlib.util.find_spec(module.split(".")[0]) is not None, "error": None, "version": None}
for package in packages:
    try:
        found["version"] = package + " " + importlib.metadata.version(package)
        break
    except importlib.metadata.PackageNotFoundError:
        pass
if found["installed"]:
    try:
        importlib.import_module(module)
    except BaseException as exc:
        found["error"] = type(exc).__name__ + ": " + str(exc)
print("\\n" + json.dumps(found), flush=True)
"""

# ibv_query_device's struct ibv_device_attr: char fw_ver[64], __be64 node_guid, __be64 sys_image_guid, then
# uint64_t max_mr_size at byte 80 (the ABI of libibverbs.so.1). Opening a device context registers nothing.
_RDMA_PROBE = """
import ctypes, json
found = {}
try:
    lib = ctypes.CDLL("libibverbs.so.1", use_errno=True)
except OSError as exc:
    print("\\n" + json.dumps({"": "cannot load libibverbs.so.1: " + str(exc)}), flush=True)
    raise SystemExit(0)
lib.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
lib.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
lib.ibv_get_device_name.restype = ctypes.c_char_p
lib.ibv_get_device_name.argtypes = [ctypes.c_void_p]
lib.ibv_open_device.restype = ctypes.c_void_p
lib.ibv_open_device.argtypes = [ctypes.c_void_p]
lib.ibv_query_device.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
lib.ibv_close_device.argtypes = [ctypes.c_void_p]
lib.ibv_free_device_list.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
count = ctypes.c_int(0)
devices = lib.ibv_get_device_list(ctypes.byref(count))
for i in range(count.value if devices else 0):
    name = lib.ibv_get_device_name(devices[i]).decode(errors="replace")
    context = lib.ibv_open_device(devices[i])
    if not context:
        found[name] = "ibv_open_device failed: errno " + str(ctypes.get_errno())
        continue
    attr = ctypes.create_string_buffer(1024)
    rc = lib.ibv_query_device(context, attr)
    found[name] = int.from_bytes(attr.raw[80:88], "little") if rc == 0 else "ibv_query_device returned " + str(rc)
    lib.ibv_close_device(context)
if devices:
    lib.ibv_free_device_list(devices)
print("\\n" + json.dumps(found), flush=True)
"""


def _last_json(process: subprocess.Popen[str], timeout: float) -> tuple[dict[str, object] | None, str]:
    """The JSON object a probe printed last, or None and why not (a crash, a hang, garbage)."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return None, f"did not finish within {timeout:.0f} s (killed)"
    lines = [line for line in out.splitlines() if line.strip()]
    if process.returncode == 0 and lines:
        try:
            found = json.loads(lines[-1])
        except ValueError:
            found = None
        if isinstance(found, dict):
            return found, ""
    tail = " ".join(err.strip().splitlines()[-2:])[-300:]
    return None, f"the interpreter importing it exited {process.returncode}" + (f": {tail}" if tail else "")


def _probe(script: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # read-only: no __pycache__ written beside the engines
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def read_engines(engines: Sequence[Engine] = ENGINES, timeout: float = PROBE_SECONDS) -> tuple[EngineFacts, ...]:
    """Import each engine's module in its own child interpreter, all at once."""
    started = [(engine, _probe(_IMPORT_PROBE, engine.module, *engine.packages)) for engine in engines]
    facts: list[EngineFacts] = []
    for engine, process in started:
        found, why = _last_json(process, timeout)
        if found is None:
            facts.append(EngineFacts(engine, installed=True, error=f"ImportError: {why}"))
            continue
        error, version = found.get("error"), found.get("version")
        facts.append(EngineFacts(
            engine, installed=bool(found.get("installed")), error=None if error is None else str(error),
            version=None if version is None else str(version),
        ))  # fmt: skip
    return tuple(facts)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""


def read_rdma(root: Path = SYSFS_INFINIBAND, timeout: float = PROBE_SECONDS) -> tuple[RdmaDevice, ...] | None:
    """The devices under ``root`` with their ports (sysfs, readable without root), and each one's
    ``max_mr_size`` from ``ibv_query_device`` in a child interpreter; None when ``root`` does not exist."""
    try:
        names = sorted(entry.name for entry in root.iterdir())
    except OSError:
        return None
    if not names:
        return ()
    answers, why = _last_json(_probe(_RDMA_PROBE), timeout)
    answers = answers or {}
    devices: list[RdmaDevice] = []
    for name in names:
        ports: list[tuple[int, str, str]] = []
        for port in sorted((root / name / "ports").glob("*"), key=lambda p: (len(p.name), p.name)):
            if port.name.isdigit():
                state = _read(port / "state").split(":")[-1].strip() or "unknown"  # "4: ACTIVE"
                ports.append((int(port.name), state, _read(port / "link_layer")))
        answer = answers.get(name, answers.get("", why or "ibv_get_device_list did not list it"))
        if isinstance(answer, int) and not isinstance(answer, bool):
            devices.append(RdmaDevice(name, tuple(ports), max_mr_size=answer))
        else:
            devices.append(RdmaDevice(name, tuple(ports), error=str(answer)))
    return tuple(devices)


def read_transfer_facts(*, probe: bool = True) -> TransferFacts:
    """This host's engines and RDMA devices now (``probe=False``: nothing read, one skip line)."""
    if not probe:
        return TransferFacts(skip_reason="not probed (--no-engines)")
    return TransferFacts(engines=read_engines(), rdma=read_rdma(), skip_reason=None)
