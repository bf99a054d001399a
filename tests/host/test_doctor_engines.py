"""pinpool doctor's transfer engine checks (issue 35, item 6): whether Mooncake's Transfer Engine and NIXL
import here (and the install line when a native library is missing), the RDMA devices' max_mr_size, and
RLIMIT_MEMLOCK against the pool for ibv_reg_mr. The checks are pure functions of injected facts; the
readers run for real: engines imported in child interpreters (a stand-in package on PYTHONPATH where the
real one is not installed), devices read from a sysfs tree."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

import pinpool
from pinpool._cli import (
    ENGINES,
    FAIL,
    OK,
    SKIP,
    WARN,
    CudaFacts,
    DoctorFacts,
    EngineFacts,
    RdmaDevice,
    TransferFacts,
    check_engine,
    check_rdma,
    check_rdma_memlock,
    library_fix,
    read_engines,
    read_rdma,
    render_text,
    run_checks,
)
from pinpool._errors import RAISE_MEMLOCK
from pinpool.testing import host_facts

MiB, GiB, TiB = 1 << 20, 1 << 30, 1 << 40
MOONCAKE, NIXL = ENGINES
LIBIBVERBS = "ImportError: libibverbs.so.1: cannot open shared object file: No such file or directory"
HOST = host_facts(memlock_soft=8 * MiB, memlock_hard=8 * MiB, cap_ipc_lock=False, mem_available=100 * GiB)
NIC = RdmaDevice("mlx5_0", ports=((1, "ACTIVE", "InfiniBand"),), max_mr_size=TiB)


def names_and_statuses(facts: TransferFacts, size: int | None = None) -> dict[str, str]:
    checks = run_checks(DoctorFacts(host=HOST, cuda=CudaFacts(skip_reason="no GPU"), env={}, transfer=facts), size)
    return {c.name: c.status for c in checks if c.name in ("engines", "mooncake", "nixl", "rdma", "memlock:rdma")}


def test_engines_come_after_cuda_and_are_skipped_when_not_probed() -> None:
    checks = run_checks(DoctorFacts(host=HOST, cuda=CudaFacts(skip_reason="no GPU"), env={}), GiB)
    names = [c.name for c in checks]
    assert names[names.index("cuda") + 1 : names.index("env")] == ["engines"]
    assert checks[names.index("engines")].status == SKIP
    probed = TransferFacts(engines=(EngineFacts(MOONCAKE, installed=False), EngineFacts(NIXL, installed=False)),
                           rdma=None, skip_reason=None)  # fmt: skip
    assert names_and_statuses(probed, GiB) == {"mooncake": SKIP, "nixl": SKIP, "rdma": SKIP, "memlock:rdma": SKIP}


def test_an_engine_that_imports() -> None:
    check = check_engine(EngineFacts(MOONCAKE, installed=True, version="mooncake-transfer-engine-non-cuda 0.3.13"))
    assert check == pinpool._cli.Check(
        "mooncake", OK,
        "Mooncake's Transfer Engine (MooncakeRegistrar): mooncake.engine imports (mooncake-transfer-engine-non-cuda "
        "0.3.13)",
    )  # fmt: skip


def test_an_engine_not_installed_says_what_to_install() -> None:
    check = check_engine(EngineFacts(NIXL, installed=False))
    assert check.status == SKIP and "nixl_cu12._api is not installed" in check.detail
    assert check.fix == "to use it: pip install nixl-cu12"


def test_a_missing_native_library_names_the_package() -> None:
    check = check_engine(EngineFacts(MOONCAKE, installed=True, error=LIBIBVERBS))
    assert check.status == WARN
    assert check.detail.endswith(f"does not import: {LIBIBVERBS}")
    assert check.fix == "apt-get install libibverbs1 (Debian/Ubuntu: it provides libibverbs.so.1)"
    assert library_fix("OSError: libucp.so.0: cannot open shared object file") is not None
    assert "apt-get install libucx0" in str(library_fix("OSError: libucp.so.0: cannot open shared object file"))
    unknown = library_fix("ImportError: libfoo.so.7: cannot open shared object file: No such file or directory")
    assert unknown == (
        "install the system library that provides libfoo.so.7 (Debian/Ubuntu: apt-file search libfoo.so.7)"
    )
    other = check_engine(EngineFacts(NIXL, installed=True, error="AttributeError: module has no attribute 'x'"))
    assert other.status == WARN and "pip install --force-reinstall nixl-cu12" in other.fix


def test_rdma_devices_and_max_mr_size() -> None:
    assert check_rdma(None, GiB).detail == (
        "no RDMA devices (/sys/class/infiniband is empty or absent): TCP transport only"
    )
    assert check_rdma((), GiB).status == SKIP
    good = check_rdma((NIC,), 64 * GiB)
    assert good.status == OK
    assert good.detail == "RDMA devices: mlx5_0 (port 1 ACTIVE InfiniBand; max_mr_size 1 TiB)"
    small = dataclasses.replace(NIC, max_mr_size=64 * GiB)
    too_big = check_rdma((small,), 128 * GiB)
    assert too_big.status == WARN and "more than mlx5_0's max_mr_size" in too_big.detail
    assert f"limits.max_bytes <= {64 * GiB}" in too_big.fix
    down = check_rdma((dataclasses.replace(NIC, ports=((1, "DOWN", "Ethernet"),)),), None)
    assert down.status == WARN and "mlx5_0 has no active port" in down.detail and "ibv_devinfo" in down.fix
    unread = check_rdma((RdmaDevice("rxe0", error="ibv_open_device failed: errno 13"),), None)
    assert unread.status == OK and "max_mr_size unread (ibv_open_device failed: errno 13)" in unread.detail


@pytest.mark.parametrize(
    ("soft", "cap", "size", "status"),
    [
        (None, False, 64 * GiB, OK),  # unlimited
        (8 * MiB, True, 64 * GiB, OK),  # CAP_IPC_LOCK
        (128 * GiB, False, 64 * GiB, OK),
        (8 * MiB, False, 64 * GiB, FAIL),
        (8 * MiB, False, None, WARN),
    ],
)
def test_memlock_for_rdma(soft: int | None, cap: bool, size: int | None, status: str) -> None:
    host = dataclasses.replace(HOST, memlock_soft=soft, memlock_hard=soft, cap_ipc_lock=cap)
    check = check_rdma_memlock((NIC,), host, size)
    assert check.status == status
    if status != OK:
        assert check.fix == RAISE_MEMLOCK and "ibv_reg_mr" in check.detail
    # Without a device nothing is pinned by the engines' TCP transports: nothing to check.
    assert check_rdma_memlock(None, host, size).status == SKIP


def test_the_doctor_fails_on_memlock_for_rdma_and_prints_the_fix() -> None:
    facts = TransferFacts(engines=(EngineFacts(MOONCAKE, installed=True, error=LIBIBVERBS),), rdma=(NIC,),
                          skip_reason=None)  # fmt: skip
    checks = run_checks(DoctorFacts(host=HOST, cuda=CudaFacts(skip_reason="no GPU"), env={}, transfer=facts), GiB)
    text = render_text(checks, GiB)
    assert "\n  warn  mooncake  Mooncake's Transfer Engine (MooncakeRegistrar): installed but" in text
    assert "fix: apt-get install libibverbs1" in text
    assert "\n  fail  memlock:rdma  --size 1 GiB registered over RDMA needs ibv_reg_mr to pin it" in text
    assert pinpool._cli.exit_code(checks) == 1


# -- the readers, for real ----------------------------------------------------------------------------------


def stand_in(root: Path, package: str, module: str, body: str) -> None:
    """A package on PYTHONPATH whose ``module`` runs ``body`` on import (the real engine is not installed)."""
    folder = root / package
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / f"{module}.py").write_text(textwrap.dedent(body))


def test_engines_are_imported_in_child_interpreters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in(tmp_path, "mooncake", "engine", f"raise ImportError({LIBIBVERBS.split(': ', 1)[1]!r})")
    stand_in(tmp_path, "nixl_cu12", "_api", """
        import sys
        print("I1207 glog noise on stdout", flush=True)
        print("E1207 and on stderr", file=sys.stderr)
        nixl_agent = object
    """)  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    mooncake, nixl = read_engines()
    assert (mooncake.installed, mooncake.error) == (True, LIBIBVERBS)
    assert (nixl.installed, nixl.error) == (True, None)
    assert check_engine(mooncake).fix.startswith("apt-get install libibverbs1")
    assert check_engine(nixl).status == OK
    assert not (tmp_path / "nixl_cu12" / "__pycache__").exists()  # read-only: nothing written beside them


def test_an_import_that_crashes_or_hangs_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in(tmp_path, "mooncake", "engine", "import os; os.abort()")
    stand_in(tmp_path, "nixl_cu12", "_api", "import time; time.sleep(3600)")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    mooncake, nixl = read_engines(timeout=3)
    assert mooncake.error is not None and "exited -6" in mooncake.error
    assert nixl.error == "ImportError: did not finish within 3 s (killed)"
    assert check_engine(nixl).status == WARN


def test_engines_absent_here_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    absent = [engine for engine in read_engines() if not engine.installed]
    for engine in absent:  # not installed in this environment (the test extra installs neither)
        assert check_engine(engine).status == SKIP


def test_rdma_devices_are_read_from_sysfs(tmp_path: Path) -> None:
    assert read_rdma(tmp_path / "absent") is None
    assert read_rdma(tmp_path) == ()
    for name, states in (("mlx5_0", ("4: ACTIVE", "1: DOWN")), ("rxe0", ("4: ACTIVE",))):
        for number, state in enumerate(states, start=1):
            port = tmp_path / name / "ports" / str(number)
            port.mkdir(parents=True)
            (port / "state").write_text(state + "\n")
            (port / "link_layer").write_text("Ethernet\n" if name == "rxe0" else "InfiniBand\n")
    devices = read_rdma(tmp_path)
    assert devices is not None and [(d.name, d.ports) for d in devices] == [
        ("mlx5_0", ((1, "ACTIVE", "InfiniBand"), (2, "DOWN", "InfiniBand"))),
        ("rxe0", ((1, "ACTIVE", "Ethernet"),)),
    ]
    # This host has no such devices: libibverbs (where it loads) does not list them, and that is said.
    assert all(d.max_mr_size is None and d.error for d in devices)
    assert check_rdma(devices, None).status == OK
