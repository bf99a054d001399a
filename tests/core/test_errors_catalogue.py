"""docs/errors.md, held to the code: every exception class pinpool defines has a row in its class
table, and every row of its input table is a case here that raises exactly that error with that
text. A row without a case, or a case without a row, fails: the page and the code cannot drift."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import importlib
import os
import pkgutil
import re
import threading
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch

import pinpool
from pinpool import layouts
from pinpool._host import libc as _libc
from pinpool._plan import CHUNK_ENV, PoolOptions, chunk_limit_from_env, plan_pool
from pinpool._types import Capabilities
from pinpool.layouts import BufferSpec
from pinpool.runtimes import MlockRuntime
from pinpool.testing import FakeRegistrar, FakeRuntime, host_facts

from ..conftest import check_host

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "errors.md"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# -- the page ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    section: str
    input: str
    example: str
    error: str
    fragment: str


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _code(cell: str) -> str:
    """A cell's text without its code-span backticks."""
    return re.sub(r"`([^`]*)`", r"\1", cell).strip()


def table_rows(heading: str) -> list[list[str]]:
    """The body rows of every table between ``## heading`` and the next ``## ``."""
    rows, inside, section = [], False, ""
    for line in (DOC.read_text() if DOC.exists() else "").splitlines():
        if line.startswith("## "):
            inside = line[3:].strip() == heading
            continue
        if not inside:
            continue
        if line.startswith("### "):
            section = line[4:].strip()
        elif line.startswith("|") and not re.fullmatch(r"\|[\s|:-]+\|?", line.strip()):
            cells = _cells(line)
            if cells[0] not in ("Input", "Class"):  # a header row
                rows.append([section, *cells])
    return rows


def doc_rows() -> list[Row]:
    return [
        Row(section, _code(inp), _code(example), _code(error), _code(fragment))
        for section, inp, example, error, fragment in table_rows("Every input pinpool checks")
    ]


# -- the cases: one per row, keyed by the row's Example cell ---------------------------------------------------

HOST = host_facts(mem_available=16 * GiB, numa_nodes=(0, 1))
CONTAINER = dataclasses.replace(
    HOST, cgroup_memory_limit=2 * GiB, cgroup_memory_usage=300 * MiB, cgroup_version=2, cgroup_path="/pod/c1"
)
NO_CAP = dataclasses.replace(HOST, cap_ipc_lock=False, memlock_soft=64 * KiB, memlock_hard=64 * KiB)


# Pools that share one budget (pinpool.share): a DSA model's KV, indexer and draft KV pools.
TRIO = {
    "kv": layouts.MLA("page_first", 2, 64, 576, torch.bfloat16),
    "indexer": layouts.Indexer("page_first", 2, 64, 128, 128),
    "draft": layouts.MHA("page_first", 1, 64, 2, 64, torch.bfloat16),
}
FOUR_CHUNKS: dict[str, object] = {"size": 4 * MiB, "chunk_bytes": MiB, "max_retries": 0}
ONE_CHUNK: dict[str, object] = {"size": MiB, "max_retries": 0}


def pool(**kwargs: object) -> pinpool.PinnedPool:
    kwargs.setdefault("size", MiB)
    kwargs.setdefault("runtime", FakeRuntime())
    kwargs.setdefault("registry", None)
    return pinpool.PinnedPool(**kwargs)  # type: ignore[arg-type]


def enter(p: pinpool.PinnedPool) -> None:
    with p:
        pass


def background_failure() -> None:
    with pool(runtime=FakeRuntime(fail_register_on=2), background=True, **FOUR_CHUNKS) as p:
        p.wait_ready_sync(timeout=30)


def nan_timeout() -> None:
    with pool(background=True) as p:
        p.wait_ready_sync(timeout=float("nan"))


class Custom:
    """A custom layout that answers what it is given (raising exceptions it is given)."""

    def __init__(self, name: object = "mine", page_bytes: object = 4096, buffers: object = None) -> None:
        self._name, self._page_bytes, self._buffers = name, page_bytes, buffers

    @property
    def name(self) -> object:
        return self._name

    @property
    def page_bytes(self) -> object:
        if isinstance(self._page_bytes, Exception):
            raise self._page_bytes
        return self._page_bytes

    def buffers(self, num_pages: int) -> object:
        if isinstance(self._buffers, Exception):
            raise self._buffers
        if self._buffers is None:
            return (BufferSpec("data", (num_pages * 4096,), torch.uint8, None),)
        return self._buffers


def spec(name: str = "data", granularity: object = None) -> BufferSpec:
    return BufferSpec(name, (4096,), torch.uint8, granularity)  # type: ignore[arg-type]


def with_env(name: str, value: str, call: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with mock.patch.dict("os.environ", {name: value}):
            return call()

    return run


def strict_chunk_env(value: str) -> Callable[[], object]:
    def run() -> object:
        return chunk_limit_from_env({CHUNK_ENV: value})

    return run


def no_gpu(call: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        if torch.cuda.is_available():
            pytest.skip("this host has a CUDA device")
        return call()

    return run


class LiesAboutPopulate:
    name = "liar"
    capabilities = Capabilities(populates=True)

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


def twice_pinned() -> None:
    tensor = torch.empty(MiB, dtype=torch.uint8)
    with pinpool.pin(tensor, runtime=FakeRuntime(), registry=None):
        enter(pinpool.pin(tensor, runtime=FakeRuntime(), registry=None))


def no_threads() -> None:
    p = pool(size=4 * MiB, chunk_bytes=MiB)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with mock.patch.object(threading.Thread, "start", refuse):
        enter(p)


def mmap_fails() -> None:
    with mock.patch.object(_libc, "mmap_anonymous", return_value=(0, errno.ENOMEM)):
        enter(pool())


def dontfork_fails() -> None:
    """madvise(MADV_DONTFORK) refused: the mapping is given back, nothing is pinned."""
    real = _libc.madvise

    def madvise(address: int, length: int, advice: int) -> int:
        return errno.EINVAL if advice == _libc.MADV_DONTFORK else real(address, length, advice)

    fake = FakeRuntime()
    with mock.patch.object(_libc, "madvise", madvise):
        try:
            enter(pool(runtime=fake))
        finally:
            assert fake.register_calls == []


def node_busy(tmp: Path) -> None:
    """The first pool holds the node's whole byte budget while it is open; the second does not wait."""
    with pool(size=4 * MiB, node_budget=4 * MiB, node_dir=str(tmp)):
        enter(pool(size=MiB, node_budget=4 * MiB, node_dir=str(tmp), node_wait=False, name="second"))


def unwritable_node_dir(tmp: Path) -> None:
    """A node_dir of mode 0500. Root passes every permission check, so for root the kernel's
    answer to a non-root owner (``access(W_OK)`` refused) stands in."""
    directory = tmp / "read-only"
    directory.mkdir(mode=0o500)
    as_root = mock.patch.object(os, "access", return_value=False) if os.geteuid() == 0 else contextlib.nullcontext()
    try:
        with as_root:
            pool(node_slots=1, node_dir=str(directory))
    finally:
        directory.chmod(0o700)


def planted_slot_file(tmp: Path, plant: Callable[[Path], None]) -> None:
    """The pool is built, then ``plant`` puts something in place of ``slot-0``, then it is entered."""
    directory = tmp / "node"
    p = pool(node_slots=1, node_dir=str(directory))
    plant(directory / "slot-0")
    enter(p)


def hard_link_to(target: Path) -> Callable[[Path], None]:
    def plant(path: Path) -> None:
        target.write_bytes(b"not pinpool's\n")
        target.chmod(0o600)
        os.link(target, path)

    return plant


def entered_twice() -> None:
    p = pool()
    enter(p)
    enter(p)


def closed_during_open() -> None:
    # A close() on another thread while this one opens the pool (the second register waits for it).
    fake = FakeRuntime()
    p = pool(runtime=fake, **FOUR_CHUNKS)
    closer = threading.Thread(target=p.close)

    def first_register(op: str, ptr: int, nbytes: int) -> None:
        if op == "register" and closer.ident is None:
            closer.start()
            closer.join(0.3)  # the close() waits for this entry: it asked it to stop, and this call ends it

    fake.before_call = first_register
    try:
        p.open()
    finally:
        closer.join(10)


def tensor_of_closed_pool() -> None:
    p = pool()
    enter(p)
    p.tensor  # noqa: B018


def fake_fail_next() -> None:
    FakeRuntime().fail_next(1, "map")


def pieces_not_registered() -> object:
    held = threading.Event()

    def hold(op: str, ptr: int, nbytes: int) -> None:
        if op == "register" and len(engine.register_calls) > 1:
            held.wait(10)  # the first registration only, until the pieces were asked for

    engine = FakeRegistrar("engine", before_call=hold)
    with pool(size=4 * MiB, chunk_bytes=MiB, registrars=[engine], background=True) as background:
        try:
            background.wait_ready_sync(min_bytes=MiB, timeout=10)
            return background.transfer_pieces(engine, offset=0, nbytes=4 * MiB)
        finally:
            held.set()


def stranger_pieces() -> object:
    with pool(registrars=[FakeRegistrar("engine")]) as entered:
        return entered.transfer_pieces(FakeRegistrar("stranger"), offset=0, nbytes=1)


def cases(tmp: Path) -> dict[str, Callable[[], object]]:
    bad_layout = layouts.Raw(granularity_bytes=MiB)
    return {
        # PinnedPool(...) and PoolOptions
        'size="lots"': lambda: pool(size="lots"),
        'size="1_0GiB"': lambda: pool(size="1_0GiB"),
        'size="١٠GiB"': lambda: pool(size="١٠GiB"),
        'size="12XB"': lambda: pool(size="12XB"),
        "size=0": lambda: pool(size=0),
        "size=True": lambda: pool(size=True),
        "size=1.5": lambda: pool(size=1.5),
        'size="1e40"': lambda: pool(size="1e40"),
        'size="1KiB", layout=Raw(granularity_bytes=1 MiB)': lambda: pool(size="1KiB", layout=bad_layout),
        "size=2**200": lambda: pool(size=2**200),
        "size=-10**5000": lambda: pool(size=-(10**5000)),
        "layout=object()": lambda: pool(layout=object()),
        "a custom layout with page_bytes = 0": lambda: pool(layout=Custom(page_bytes=0)),
        "a custom layout whose page_bytes raises ZeroDivisionError": lambda: pool(
            layout=Custom(page_bytes=ZeroDivisionError("division by zero"))
        ),
        "a custom layout whose buffers() returns [1]": lambda: pool(layout=Custom(buffers=[1])),
        "a custom layout whose buffers() raises": lambda: pool(layout=Custom(buffers=RuntimeError("boom"))),
        "a custom layout whose buffers() returns ()": lambda: pool(layout=Custom(buffers=())),
        "a BufferSpec with granularity 0": lambda: pool(layout=Custom(buffers=(spec(granularity=0),))),
        "two BufferSpecs named data": lambda: pool(layout=Custom(buffers=(spec(), spec()))),
        "a custom layout named ''": lambda: pool(layout=Custom(name="")),
        'chunk_bytes="abc"': lambda: pool(chunk_bytes="abc"),
        'chunk_bytes="1MiB", layout=Raw(granularity_bytes=3 MiB)': lambda: pool(
            size=16 * MiB, chunk_bytes="1MiB", layout=layouts.Raw(granularity_bytes=3 * MiB)
        ),
        'chunk_bytes="2MiB", max_chunk_bytes="1MiB"': lambda: pool(chunk_bytes="2MiB", max_chunk_bytes="1MiB"),
        'chunk_bytes="buffer", max_call_seconds=0.02': lambda: pool(chunk_bytes="buffer", max_call_seconds=0.02),
        'chunk_bytes="buffer", max_chunk_bytes="1MiB", size="4MiB"': lambda: pool(
            chunk_bytes="buffer", max_chunk_bytes="1MiB", size="4MiB"
        ),
        'max_chunk_bytes="abc"': lambda: pool(max_chunk_bytes="abc"),
        'chunk_bytes="1MiB", max_call_seconds=0.02': lambda: pool(chunk_bytes="1MiB", max_call_seconds=0.02),
        "populate=1": lambda: pool(populate=1),
        "populate=True on Linux < 5.14": lambda: plan_pool(
            PoolOptions(size=MiB, populate=True), dataclasses.replace(HOST, populate_write=False), Capabilities()
        ),
        "populate_workers=0": lambda: pool(populate_workers=0),
        "register_workers=True": lambda: pool(register_workers=True),
        "unpin_workers=-1": lambda: pool(unpin_workers=-1),
        "populate_workers=10**6": lambda: pool(populate_workers=10**6),
        'huge_pages="thp"': lambda: pool(huge_pages="thp"),
        "huge_pages=True with THP never": lambda: check_host(
            PoolOptions(size=MiB, huge_pages=True), dataclasses.replace(HOST, thp_mode="never")
        ),
        'huge_pages="hugetlb" with too few free pages': lambda: check_host(
            PoolOptions(size=8 * MiB, huge_pages="hugetlb"), dataclasses.replace(HOST, hugetlb_free=1, hugetlb_total=1)
        ),
        'huge_pages="hugetlb:1GiB" with no 1 GiB pages reserved': lambda: check_host(
            PoolOptions(size=2 * GiB, huge_pages="hugetlb:1GiB"), HOST
        ),
        'empty(8, huge_pages="hugetlb:4MiB")': lambda: pinpool.empty(8, huge_pages="hugetlb:4MiB"),
        'numa_node="0"': lambda: pool(numa_node="0"),
        "numa_node=-1": lambda: pool(numa_node=-1),
        "numa_node=7 on a host with nodes 0, 1": lambda: check_host(PoolOptions(size=MiB, numa_node=7), HOST),
        'name=""': lambda: pool(name=""),
        'min_chunk_bytes="0"': lambda: pool(min_chunk_bytes="0"),
        "max_retries=-1": lambda: pool(max_retries=-1),
        "max_retries=65": lambda: pool(max_retries=65),
        'retry_codes="1,2"': lambda: pool(retry_codes="1,2"),
        "retry_codes=(0,)": lambda: pool(retry_codes=(0,)),
        "max_call_seconds=0": lambda: pool(max_call_seconds=0),
        'max_call_seconds=float("nan")': lambda: pool(max_call_seconds=float("nan")),
        "max_call_seconds=1e300": lambda: pool(max_call_seconds=1e300),
        'max_call_seconds="fast"': lambda: pool(max_call_seconds="fast"),
        "num_pages=0, size=None": lambda: pool(num_pages=0, size=None),
        'num_pages=4, size="1MiB"': lambda: pool(num_pages=4, size="1MiB"),
        'background="yes"': lambda: pool(background="yes"),
        "node_slots=0": lambda: pool(node_slots=0, node_dir=str(tmp)),
        'node_budget="1.5"': lambda: pool(node_budget="1.5", node_dir=str(tmp)),
        'node_budget="١٠%"': lambda: pool(node_budget="١٠%", node_dir=str(tmp)),
        'node_dir="relative/dir"': lambda: pool(node_slots=1, node_dir="relative/dir"),
        'node_wait="no"': lambda: pool(node_slots=1, node_dir=str(tmp), node_wait="no"),
        "node_dir= a directory of mode 0500 (not as root)": lambda: unwritable_node_dir(tmp),
        'runtime="gpu"': lambda: pool(runtime="gpu"),
        "runtime=object()": lambda: pool(runtime=object()),
        "registrars=[object()]": lambda: pool(registrars=[object()]),
        "two registrars named x": lambda: pool(registrars=[FakeRegistrar("x"), FakeRegistrar("x")]),
        "a registrar with limits.preferred_bytes above limits.max_bytes": lambda: pool(
            registrars=[FakeRegistrar(max_bytes=MiB, preferred_bytes=2 * MiB)]
        ),
        'chunk_bytes="16MiB" with a registrar of max_bytes 8 MiB': lambda: pool(
            size=32 * MiB, chunk_bytes="16MiB", registrars=[FakeRegistrar("engine", max_bytes=8 * MiB)]
        ),
        "a registrar whose page-table budget the pool exceeds": lambda: pool(
            size=8 * MiB, registrars=[FakeRegistrar("efa", page_table_entries=1000)]
        ),
        'runtime="cuda" on a host without CUDA': no_gpu(lambda: pool(runtime="cuda")),
        "a runtime declaring populates=True without populate()": lambda: pool(runtime=LiesAboutPopulate()),
        'registry="default"': lambda: pool(registry="default"),
        "logger=object()": lambda: pool(logger=object()),
        "on_progress=3": lambda: pool(on_progress=3),
        # pin()
        'pin("tensor")': lambda: pinpool.pin("tensor"),  # type: ignore[arg-type]
        'pin(torch.empty(4, device="meta"))': lambda: pinpool.pin(torch.empty(4, device="meta")),
        "pin(torch.empty(4, 4).t())": lambda: pinpool.pin(torch.empty(4, 4).t()),
        "pin(torch.empty(0))": lambda: pinpool.pin(torch.empty(0)),
        "pin(t, granularity_bytes=0)": lambda: pinpool.pin(torch.empty(4), granularity_bytes=0),
        "pin(torch.empty(10).as_strided((4, 4), (2, 1)))": lambda: pinpool.pin(
            torch.empty(10).as_strided((4, 4), (2, 1))
        ),
        "pin(t, ranges=[])": lambda: pinpool.pin(torch.empty(4), ranges=[]),
        "pin(t, ranges=5)": lambda: pinpool.pin(torch.empty(4), ranges=5),  # type: ignore[arg-type]
        "pin(t, ranges=[(0, 4, 1)])": lambda: pinpool.pin(torch.empty(4), ranges=[(0, 4, 1)]),  # type: ignore[list-item]
        "pin(t, ranges=[(0, 0)])": lambda: pinpool.pin(torch.empty(4), ranges=[(0, 0)]),
        "pin(t, ranges=[(8, 16)]) of 16 bytes": lambda: pinpool.pin(torch.empty(4), ranges=[(8, 16)]),
        "pin(t, ranges=[(0, 8), (4, 8)])": lambda: pinpool.pin(torch.empty(4), ranges=[(0, 8), (4, 8)]),
        "pin(t.t(), ranges=[(0, 8)])": lambda: pinpool.pin(torch.empty(4, 4).t(), ranges=[(0, 8)]),
        "pin(t, ranges=[(0, 8), (16, 8)], runtime=FakeRuntime(exact_ranges=False))": lambda: pinpool.pin(
            pinpool.empty(64, dtype=torch.uint8), ranges=[(0, 8), (16, 8)], runtime=FakeRuntime(exact_ranges=False)
        ),
        # layouts
        "Raw(granularity_bytes=-1)": lambda: layouts.Raw(granularity_bytes=-1),
        'MHA("bad", 2, 4, 2, 16, torch.float16)': lambda: layouts.MHA("bad", 2, 4, 2, 16, torch.float16),
        'MHA("page_first", 0, 4, 2, 16, torch.float16)': lambda: layouts.MHA("page_first", 0, 4, 2, 16, torch.float16),
        'MHA("page_first", 2, 4, 2, 16, "bf17")': lambda: layouts.MHA("page_first", 2, 4, 2, 16, "bf17"),  # type: ignore[arg-type]
        "MHA(..., k_only=True, v_head_dim=8)": lambda: layouts.MHA(
            "page_first", 2, 4, 2, 16, torch.float16, k_only=True, v_head_dim=8
        ),
        'MHA("layer_first", ..., v_head_dim=8)': lambda: layouts.MHA(
            "layer_first", 2, 4, 2, 16, torch.float16, v_head_dim=8
        ),
        'MLA("page_first", 2, 4, 0, torch.bfloat16)': lambda: layouts.MLA("page_first", 2, 4, 0, torch.bfloat16),
        'Mamba(2, "x", (), torch.float32)': lambda: layouts.Mamba(2, "x", (), torch.float32),  # type: ignore[arg-type]
        "Mamba(2, (3,), 5, torch.float32)": lambda: layouts.Mamba(2, (3,), 5, torch.float32),  # type: ignore[arg-type]
        "Mamba(2, (0,), ((0, 2),), torch.float32)": lambda: layouts.Mamba(2, (0,), ((0, 2),), torch.float32),
        'Mamba(2, (3,), ((2, 2),), torch.float32, conv_dtype="bf17")': lambda: layouts.Mamba(
            2, (3,), ((2, 2),), torch.float32, conv_dtype="bf17"  # type: ignore[arg-type]
        ),
        "Mamba(2, (3,), ((2, 2),), temporal_dtype=torch.float32)": lambda: layouts.Mamba(
            2, (3,), ((2, 2),), temporal_dtype=torch.float32
        ),
        'Indexer("page_first", 2, 4, 100, 64)': lambda: layouts.Indexer("page_first", 2, 4, 100, 64),
        'PagedBytes("page_first", 2, 0)': lambda: layouts.PagedBytes("page_first", 2, 0),
        'PagedBytes.state("page_first", 2, 0, 64)': lambda: layouts.PagedBytes.state("page_first", 2, 0, 64),
        'MHA("page_unified", ..., head_num=8, head_group_num=3)': lambda: layouts.MHA(
            "page_unified", 2, 4, 8, 16, torch.bfloat16, head_group_num=3
        ),
        'MHA("page_first", ..., head_group_num=2)': lambda: layouts.MHA(
            "page_first", 2, 4, 8, 16, torch.bfloat16, head_group_num=2
        ),
        'MLA("page_first_kv_split", 2, 4, 576, torch.bfloat16)': lambda: layouts.MLA(
            "page_first_kv_split", 2, 4, 576, torch.bfloat16
        ),
        'MLA("page_first", ..., qk_rope_head_dim=64)': lambda: layouts.MLA(
            "page_first", 2, 4, 576, torch.bfloat16, qk_rope_head_dim=64
        ),
        'MLA("page_first_kv_split", ..., index_layer_num=2)': lambda: layouts.MLA(
            "page_first_kv_split", 2, 4, 576, torch.bfloat16, qk_rope_head_dim=64, index_layer_num=2
        ),
        'MLA("page_first_kv_split", ..., index_scales=True)': lambda: layouts.MLA(
            "page_first_kv_split", 2, 4, 576, torch.bfloat16, qk_rope_head_dim=64, index_scales=True
        ),
        "Dense((2, 0), torch.uint8)": lambda: layouts.Dense((2, 0), torch.uint8),
        'Dense((2, 4), "bf17")': lambda: layouts.Dense((2, 4), "bf17"),  # type: ignore[arg-type]
        "Dense((2, 4), torch.uint8, page_dim=2)": lambda: layouts.Dense((2, 4), torch.uint8, page_dim=2),
        'Dense((2, 4), torch.uint8, buffer="")': lambda: layouts.Dense((2, 4), torch.uint8, buffer=""),
        "Dense((2, 4), torch.uint8, granularity_bytes=0)": lambda: layouts.Dense(
            (2, 4), torch.uint8, granularity_bytes=0
        ),
        "Dense((2, 1, 64), torch.bfloat16, page_dim=1, granularity_bytes=96)": lambda: layouts.Dense(
            (2, 1, 64), torch.bfloat16, page_dim=1, granularity_bytes=96
        ),
        # environment variables
        "PINPOOL_REGISTER_CHUNK_GB=abc": with_env(CHUNK_ENV, "abc", pool),
        "PINPOOL_REGISTER_CHUNK_GB=0": with_env(CHUNK_ENV, "0", pool),
        "PINPOOL_REGISTER_CHUNK_GB=1e-12": with_env(CHUNK_ENV, "1e-12", pool),
        "PINPOOL_REGISTER_CHUNK_GB=1_0": strict_chunk_env("1_0"),
        "PINPOOL_REGISTER_CHUNK_GB=١٠": strict_chunk_env("١٠"),
        "PINPOOL_NODE_SLOTS=two": with_env("PINPOOL_NODE_SLOTS", "two", lambda: pool(node_dir=str(tmp))),
        "PINPOOL_NODE_BUDGET=lots": with_env("PINPOOL_NODE_BUDGET", "lots", lambda: pool(node_dir=str(tmp))),
        "PINPOOL_NODE_DIR=relative/dir": with_env(
            "PINPOOL_NODE_DIR", "relative/dir", lambda: pool(node_slots=1)
        ),
        # the host, before anything is mapped
        "a 4 GiB pool in a 2 GiB memory cgroup": lambda: check_host(PoolOptions(size=4 * GiB), CONTAINER, "mlock"),
        "a 32 GiB pool with 16 GiB MemAvailable": lambda: check_host(PoolOptions(size=32 * GiB), HOST, "auto"),
        "a 1 MiB mlock pool, RLIMIT_MEMLOCK 64 KiB, no CAP_IPC_LOCK": lambda: check_host(
            PoolOptions(size=MiB), NO_CAP, "mlock"
        ),
        # while pinning, and the pool's state
        "entering a pool a second time": entered_twice,
        "close() while the pool is being opened": closed_during_open,
        "pool.tensor after exit": tensor_of_closed_pool,
        "pin() of a tensor pinpool already pins": twice_pinned,
        "a registration fails": lambda: enter(pool(runtime=FakeRuntime(fail_register_on=2), **FOUR_CHUNKS)),
        "a registration fails while a background pool pins": background_failure,
        "exiting a pool that was never entered": lambda: pool().__exit__(None, None, None),
        'wait_ready_sync(timeout=float("nan"))': nan_timeout,
        "a registrar's registration fails": lambda: enter(
            pool(registrars=[FakeRegistrar("engine", fail_register_on=1)], **FOUR_CHUNKS)
        ),
        "transfer_pieces() of pages not yet registered": pieces_not_registered,
        "transfer_pieces() of a registrar the pool does not have": stranger_pieces,
        "pre-faulting fails with ENOMEM": lambda: enter(pool(runtime=FakeRuntime(fail_populate_on=1), **FOUR_CHUNKS)),
        "no worker thread can be started": no_threads,
        "an unregistration fails at exit": lambda: enter(pool(runtime=FakeRuntime(fail_unregister_on=1), **ONE_CHUNK)),
        "mmap of the pool fails": mmap_fails,
        "madvise(MADV_DONTFORK) of the pool fails": dontfork_fails,
        "node_wait=False and the node's byte budget is held": lambda: node_busy(tmp),
        "a FIFO in place of the file slot-0 in node_dir": lambda: planted_slot_file(
            tmp, lambda path: os.mkfifo(path, 0o600)
        ),
        "a hard link in place of the file slot-0 in node_dir": lambda: planted_slot_file(
            tmp, hard_link_to(tmp / "precious")
        ),
        "MlockRuntime().unregister(base it never registered)": lambda: MlockRuntime().unregister(4096),
        # pinpool.share / pinpool.host_budget
        "share(200703, MLA + Indexer + MHA layouts)": lambda: pinpool.share(200703, TRIO, host=HOST),
        'share("1GiB", {})': lambda: pinpool.share("1GiB", {}, host=HOST),
        'share("1GiB", layouts, num_pages=3)': lambda: pinpool.share("1GiB", TRIO, host=HOST, num_pages=3),
        'shares.pool("kv", num_pages=341)': lambda: pinpool.share("64MiB", TRIO, host=HOST).pool("kv", num_pages=341),
        "host_budget(fraction=1.5)": lambda: pinpool.host_budget(fraction=1.5, host=HOST, environ={}),
        'host_budget(reserve="20GiB") with 16 GiB available': lambda: pinpool.host_budget(
            reserve="20GiB", host=HOST, environ={}
        ),
        "host_budget(ranks=0)": lambda: pinpool.host_budget(ranks=0, host=HOST, environ={}),
        "LOCAL_WORLD_SIZE=eight, host_budget()": lambda: pinpool.host_budget(
            host=HOST, environ={"LOCAL_WORLD_SIZE": "eight"}
        ),
        "host_budget(ranks=2**40)": lambda: pinpool.host_budget(ranks=2**40, host=HOST, environ={}),
        # pinpool.testing.FakeRuntime
        "FakeRuntime(fail_register_on=0)": lambda: FakeRuntime(fail_register_on=0),
        'FakeRuntime(fail_register_larger_than="lots")': lambda: FakeRuntime(fail_register_larger_than="lots"),
        "FakeRuntime(register_delay=-1)": lambda: FakeRuntime(register_delay=-1),
        "FakeRuntime(lock_on_fault=1)": lambda: FakeRuntime(lock_on_fault=1),  # type: ignore[arg-type]
        "FakeRuntime(before_call=3)": lambda: FakeRuntime(before_call=3),  # type: ignore[arg-type]
        'fake.fail_next(1, "map")': fake_fail_next,
    }  # fmt: skip


# -- the tests -----------------------------------------------------------------------------------------------


def test_every_row_has_a_case_and_every_case_a_row(tmp_path: Path) -> None:
    rows = [r.example for r in doc_rows()]
    assert len(rows) == len(set(rows)), "two rows share an Example"
    known = cases(tmp_path)
    assert sorted(set(rows) - set(known)) == [], "rows of docs/errors.md without a case here"
    assert sorted(set(known) - set(rows)) == [], "cases here without a row in docs/errors.md"


@pytest.mark.parametrize("row", doc_rows(), ids=lambda r: r.example)
def test_row(row: Row, tmp_path: Path) -> None:
    error = getattr(pinpool, row.error, None) or getattr(pinpool._errors, row.error)
    with pytest.raises(error) as info:
        cases(tmp_path)[row.example]()
    assert type(info.value).__name__ == row.error
    assert row.fragment in str(info.value), f"{row.fragment!r} not in {str(info.value)!r}"


def every_error_class() -> set[type[BaseException]]:
    """PinpoolError and every subclass, in every module of pinpool; and pinpool's warnings."""
    for module in pkgutil.walk_packages(pinpool.__path__, "pinpool."):
        if not module.name.endswith("__main__"):  # that one runs the command line
            importlib.import_module(module.name)
    found: set[type[BaseException]] = set()
    todo: list[type[BaseException]] = [pinpool.PinpoolError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("pinpool") and cls not in found:
            found.add(cls)
            todo.extend(cls.__subclasses__())
    return found | {pinpool.UnclosedPoolWarning}


def test_every_exception_class_has_a_row() -> None:
    table = {_code(cells[1]): _code(cells[2]) for cells in table_rows("Exceptions")}
    classes = {cls.__name__: cls for cls in every_error_class()}
    assert sorted(set(classes) - set(table)) == [], "exception classes missing from docs/errors.md"
    internal = {"LedgerError", "TransitionError"}  # invariant breaches, not PinpoolErrors (see below)
    assert sorted(set(table) - set(classes) - internal) == [], "rows for classes pinpool does not define"
    for name, also in table.items():
        if name in classes and also not in ("", "-"):
            for builtin in also.split(", "):
                assert issubclass(classes[name], getattr(builtins, builtin)), (name, builtin)


def test_ledger_error_is_said_to_never_reach_users() -> None:
    text = DOC.read_text()
    assert "LedgerError" in text and "never reach" in text
    from pinpool._errors import LedgerError
    from pinpool._pin import TransitionError

    assert not issubclass(LedgerError, pinpool.PinpoolError)  # an invariant breach, not an error to handle
    assert not issubclass(TransitionError, pinpool.PinpoolError)
    assert "TransitionError" in text
