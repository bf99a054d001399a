"""Chunk planning (`plan_chunks`, `chunk_limit_from_env`, the options' chunk limit) and what its modules import."""

from __future__ import annotations

import ast
import math
import re
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pinpool import ConfigError
from pinpool._plan import (
    CHUNK_ENV,
    DEFAULT_CHUNK_GIB,
    Chunk,
    ChunkPlan,
    PoolOptions,
    chunk_limit_from_env,
    plan_chunks,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE_SIZES = (4096, 16384, 65536)
MAX_CHUNKS = 1000  # keeps generated plans small; a floor on the limit enforces it (see plan_inputs)


# -- model -------------------------------------------------------------------------------------


def model_unit(granularity: int | None, page_size: int) -> int:
    return page_size if granularity is None else math.lcm(granularity, page_size)


def model_rejects(nbytes: int, granularity: int | None, page_size: int, limit: int) -> bool:
    """The rules: no chunk can hold one aligned unit (single registration exempt without granularity)."""
    if granularity is None:
        return nbytes > limit and page_size > limit
    return math.lcm(granularity, page_size) > limit


def model_chunk_count(nbytes: int, granularity: int | None, page_size: int, limit: int) -> int:
    if granularity is None and nbytes <= limit:
        return 1
    unit = model_unit(granularity, page_size)
    return -(-nbytes // ((limit // unit) * unit))


@st.composite
def plan_inputs(draw: st.DrawFn) -> tuple[int, int | None, int, int]:
    nbytes = draw(st.integers(1, 2**44))
    granularity = draw(
        st.none()
        | st.integers(1, 2**31)
        # small and page-multiple granularities keep lcm(granularity, page) under most limits
        | st.integers(1, 4096)
        | st.integers(1, 2**19).map(lambda k: k * 4096)
    )
    page_size = draw(st.sampled_from(PAGE_SIZES))
    limit = draw(
        st.integers(1, 2**40)
        | st.integers(2**20, 2**40)
        # limits near nbytes / k exercise exact fits, off-by-one and short last chunks
        | st.builds(lambda k, d: max(1, nbytes // k + d), st.integers(1, 64), st.integers(-2, 2))
    )
    if not model_rejects(nbytes, granularity, page_size, limit) and (
        model_chunk_count(nbytes, granularity, page_size, limit) > MAX_CHUNKS
    ):
        # Raising the limit keeps the plan valid (unit <= old limit <= new limit) and, since
        # chunk_bytes > limit / 2, bounds the plan to about 2 * MAX_CHUNKS chunks.
        limit = max(limit, nbytes // MAX_CHUNKS)
    return nbytes, granularity, page_size, limit


def check_plan(plan: ChunkPlan, nbytes: int, granularity: int | None, page_size: int, limit: int) -> None:
    """Every invariant of a plan, independent of how it was computed."""
    assert (plan.nbytes, plan.granularity, plan.page_size, plan.limit) == (nbytes, granularity, page_size, limit)
    unit = model_unit(granularity, page_size)
    assert plan.unit == unit
    chunks = plan.chunks
    assert chunks, "a plan has at least one chunk"
    assert all(isinstance(c, Chunk) for c in chunks)
    # contiguous, from 0, covering [0, nbytes) exactly
    assert chunks[0].offset == 0
    for prev, nxt in pairwise(chunks):
        assert prev.end == nxt.offset
    assert chunks[-1].end == nbytes
    assert sum(c.nbytes for c in chunks) == nbytes
    # sizes
    assert all(0 < c.nbytes <= limit for c in chunks)
    assert all(c.nbytes == plan.chunk_bytes for c in chunks[:-1])
    assert chunks[-1].nbytes <= plan.chunk_bytes
    # boundaries: multiples of the granularity and of the OS page; no OS page in two chunks
    for prev, nxt in pairwise(chunks):
        assert nxt.offset % page_size == 0
        if granularity is not None:
            assert nxt.offset % granularity == 0
        assert (prev.end - 1) // page_size < nxt.offset // page_size
    # chunk_bytes: the whole buffer when it is one unconstrained registration, otherwise the
    # largest multiple of unit within the limit (capped at nbytes when the buffer is smaller)
    if granularity is None and nbytes <= limit:
        assert chunks == (Chunk(0, nbytes),)
        assert plan.chunk_bytes == nbytes
    else:
        full = (limit // unit) * unit
        assert full % unit == 0
        assert unit <= full <= limit < full + unit
        assert plan.chunk_bytes == min(full, nbytes)
        assert len(chunks) == -(-nbytes // full), "no more chunks than the limit forces"


# -- properties --------------------------------------------------------------------------------


@settings(deadline=None, max_examples=400)  # about half the draws are (correctly) rejected
@given(plan_inputs())
@example((2500 * MiB, 300 * MiB, 4096, GiB))
@example((2 * GiB + 17, None, 4096, GiB))
@example((3 * GiB, None, 4096, GiB))  # last chunk exactly full
@example((GiB, None, 4096, GiB))  # exactly the limit: one registration
@example((GiB + 1, None, 65536, GiB))
@example((100, 60, 4096, 61440))  # unit == limit, buffer smaller than one unit
@example((10**9, 60, 4096, 61439))  # unit one byte over the limit
@example((10**9, None, 65536, 65535))  # needs splitting, page over the limit
@example((100, None, 65536, 100))  # page over the limit, but one registration suffices
def test_plan_matches_rules(args: tuple[int, int | None, int, int]) -> None:
    nbytes, granularity, page_size, limit = args
    if model_rejects(nbytes, granularity, page_size, limit):
        with pytest.raises(ConfigError) as info:
            plan_chunks(nbytes, granularity=granularity, limit=limit, page_size=page_size)
        message = str(info.value)
        unit = model_unit(granularity, page_size)
        assert "chunk_bytes" in message
        assert CHUNK_ENV in message
        assert "raise" in message
        assert f"at least {unit} bytes" in message
        assert f"({limit} B)" in message
    else:
        plan = plan_chunks(nbytes, granularity=granularity, limit=limit, page_size=page_size)
        check_plan(plan, nbytes, granularity, page_size, limit)


@settings(deadline=None)
@given(
    nbytes=st.integers(1, 2**44),
    page_size=st.sampled_from(PAGE_SIZES),
    slack=st.integers(0, 2**40),
)
def test_no_granularity_within_limit_is_one_registration(nbytes: int, page_size: int, slack: int) -> None:
    limit = nbytes + slack  # the page may exceed the limit: a single registration needs no split
    plan = plan_chunks(nbytes, granularity=None, limit=limit, page_size=page_size)
    assert plan.chunks == (Chunk(0, nbytes),)
    assert plan.chunk_bytes == nbytes
    assert plan.granularity is None


@given(
    granularity=st.integers(1, 2**20),
    page_size=st.sampled_from(PAGE_SIZES),
    units=st.integers(1, 64),
    count=st.integers(1, 50),
    tail=st.integers(0, 1),
)
def test_buffer_of_whole_chunks(granularity: int, page_size: int, units: int, count: int, tail: int) -> None:
    """A buffer of exactly `count` full chunks (plus optionally one byte) splits into them."""
    unit = math.lcm(granularity, page_size)
    chunk_bytes = units * unit
    limit = chunk_bytes + unit - 1  # not a multiple: must round down to chunk_bytes
    nbytes = count * chunk_bytes + tail
    plan = plan_chunks(nbytes, granularity=granularity, limit=limit, page_size=page_size)
    assert plan.chunk_bytes == chunk_bytes
    expected = [Chunk(i * chunk_bytes, chunk_bytes) for i in range(count)]
    if tail:
        expected.append(Chunk(count * chunk_bytes, 1))
    assert list(plan.chunks) == expected


# -- reference vectors ----------------------------------------------------------------------------


def test_reference_granularity_300mib_limit_1gib() -> None:
    plan = plan_chunks(2500 * MiB, granularity=300 * MiB, limit=GiB, page_size=4096)
    assert plan.chunk_bytes == 900 * MiB
    assert [c.nbytes for c in plan.chunks] == [900 * MiB, 900 * MiB, 700 * MiB]
    assert [c.offset for c in plan.chunks] == [0, 900 * MiB, 1800 * MiB]
    assert all(c.offset % (300 * MiB) == 0 for c in plan.chunks)


def test_reference_no_granularity_2gib_plus_17() -> None:
    plan = plan_chunks(2 * GiB + 17, granularity=None, limit=GiB, page_size=4096)
    assert plan.chunks == (Chunk(0, GiB), Chunk(GiB, GiB), Chunk(2 * GiB, 17))
    assert plan.chunk_bytes == GiB
    assert plan.unit == 4096


def test_reference_mla_page_first_direct_granularity_60() -> None:
    # MLA page_first_direct, P=2, L=3, kv_cache_dim=5, float16: 2*3*5*2 = 60 bytes per copy page
    plan = plan_chunks(10 * GiB, granularity=60, limit=GiB, page_size=4096)
    assert plan.unit == 61440 == math.lcm(60, 4096)
    assert plan.chunk_bytes == (GiB // 61440) * 61440
    assert len(plan.chunks) > 1
    for c in plan.chunks[1:]:
        assert c.offset % 60 == 0
        assert c.offset % 4096 == 0


def test_unit_exactly_at_limit_is_accepted_one_below_is_not() -> None:
    plan = plan_chunks(200_000, granularity=60, limit=61440, page_size=4096)
    assert plan.chunk_bytes == 61440
    assert [c.nbytes for c in plan.chunks] == [61440, 61440, 61440, 200_000 - 3 * 61440]
    with pytest.raises(ConfigError, match="61440"):
        plan_chunks(200_000, granularity=60, limit=61439, page_size=4096)


def test_granularity_over_limit_is_rejected_even_for_a_small_buffer() -> None:
    # SGLang: granularity > chunk limit is a ValueError; the user must raise the limit
    with pytest.raises(ValueError, match=r"raise chunk_bytes= or PINPOOL_REGISTER_CHUNK_GB") as info:
        plan_chunks(4096, granularity=2 * GiB, limit=GiB, page_size=4096)
    assert isinstance(info.value, ConfigError)
    message = str(info.value)
    assert "granularity 2147483648 B" in message
    assert f"at least {2 * GiB} bytes" in message


# -- bad arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", [0, -1, -4096, True, False, 1.5, "4096"])
def test_bad_granularity(granularity: object) -> None:
    with pytest.raises(ConfigError) as info:
        plan_chunks(GiB, granularity=granularity, limit=GiB, page_size=4096)  # type: ignore[arg-type]
    message = str(info.value)
    assert f"registration granularity {granularity!r}" in message
    assert "None" in message  # the way out: no alignment constraint


@pytest.mark.parametrize("nbytes", [0, -1, True, 1.5, "1GiB"])
def test_bad_buffer_size(nbytes: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"buffer size {nbytes!r} must be a positive integer")):
        plan_chunks(nbytes, granularity=None, limit=GiB, page_size=4096)  # type: ignore[arg-type]


@pytest.mark.parametrize("page_size", [0, -4096, True, 4096.0])
def test_bad_page_size(page_size: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"page size {page_size!r} must be a positive integer")):
        plan_chunks(GiB, granularity=None, limit=GiB, page_size=page_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "1GiB"])
def test_bad_limit(limit: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"chunk limit {limit!r} must be a positive integer")):
        plan_chunks(GiB, granularity=None, limit=limit, page_size=4096)  # type: ignore[arg-type]


def test_page_over_limit_without_granularity_names_the_page() -> None:
    with pytest.raises(ConfigError) as info:
        plan_chunks(GiB, granularity=None, limit=60000, page_size=65536)
    message = str(info.value)
    assert "the OS page (65536 B)" in message
    assert "(60000 B)" in message
    assert f"raise chunk_bytes= or {CHUNK_ENV} to at least 65536 bytes" in message


# -- PINPOOL_REGISTER_CHUNK_GB ----------------------------------------------------------------------


def test_env_default_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CHUNK_ENV, raising=False)
    assert DEFAULT_CHUNK_GIB == 256
    assert chunk_limit_from_env() == 256 * GiB
    assert chunk_limit_from_env({}) == 256 * GiB


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("64", 64 * GiB),
        ("0.5", 512 * MiB),
        (" 2 ", 2 * GiB),
        ("1", GiB),
        ("0.1", int(0.1 * GiB)),  # fractions round down to whole bytes
        ("1024", 1024 * GiB),
        ("2.5E1", 25 * GiB),
    ],
)
def test_env_values(monkeypatch: pytest.MonkeyPatch, raw: str, expected: int) -> None:
    monkeypatch.setenv(CHUNK_ENV, raw)
    assert chunk_limit_from_env() == expected
    assert chunk_limit_from_env({CHUNK_ENV: raw}) == expected


def test_env_argument_replaces_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHUNK_ENV, "abc")  # would fail if read
    assert chunk_limit_from_env({}) == 256 * GiB
    assert chunk_limit_from_env({CHUNK_ENV: "8"}) == 8 * GiB


@pytest.mark.parametrize("raw", ["", "   ", "abc", "64GiB", "0", "-1", "-0.5", "nan", "NaN", "inf", "-inf", "1e-12"])
def test_env_bad_values(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(CHUNK_ENV, raw)
    for call in (chunk_limit_from_env, lambda: chunk_limit_from_env({CHUNK_ENV: raw})):
        with pytest.raises(ConfigError) as info:
            call()
        message = str(info.value)
        assert f"{CHUNK_ENV}={raw!r}" in message
        assert "positive number of GiB" in message  # the fix
        assert "unset it" in message


def test_env_less_than_a_byte_says_so() -> None:
    with pytest.raises(ConfigError, match="less than one byte"):
        chunk_limit_from_env({CHUNK_ENV: "1e-12"})


@pytest.mark.parametrize("raw", ["1e999999", "1e22", "9" * 5000])
def test_env_absurdly_large_is_a_config_error(raw: str) -> None:
    # "1e999999" once escaped as decimal.Overflow from the default Decimal context
    with pytest.raises(ConfigError) as info:
        chunk_limit_from_env({CHUNK_ENV: raw})
    assert str(info.value).startswith(f"{CHUNK_ENV}={raw!r} is too large to be a memory size")


def test_env_out_of_range_exponent_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=f"{CHUNK_ENV}='1e99999999999999999999' is not a number"):
        chunk_limit_from_env({CHUNK_ENV: "1e99999999999999999999"})


def test_env_large_but_representable_is_exact() -> None:
    assert chunk_limit_from_env({CHUNK_ENV: "1e21"}) == 10**21 << 30
    assert chunk_limit_from_env({CHUNK_ENV: "0." + "9" * 40}) == GiB - 1  # rounded down, exactly


# -- the chunk limit: chunk_bytes= when given, else the environment, else 256 GiB -------------------


def resolve_chunk_limit(chunk_bytes: int | str | None) -> int:
    return PoolOptions.create(size=4096, chunk_bytes=chunk_bytes).chunk_limit


def test_resolve_explicit_values_win_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHUNK_ENV, "abc")  # invalid, but not consulted
    assert resolve_chunk_limit(4096) == 4096
    assert resolve_chunk_limit("64GiB") == 64 * GiB
    assert resolve_chunk_limit("512MB") == 512 * 10**6
    assert resolve_chunk_limit(" 1.5 TiB ") == 3 * (1 << 39)


def test_resolve_none_reads_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHUNK_ENV, "3")
    assert resolve_chunk_limit(None) == 3 * GiB
    monkeypatch.delenv(CHUNK_ENV)
    assert resolve_chunk_limit(None) == 256 * GiB
    monkeypatch.setenv(CHUNK_ENV, "zero")
    with pytest.raises(ConfigError, match=CHUNK_ENV):
        resolve_chunk_limit(None)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "", "abc", "0GiB", "12XB", "-1GiB"])
def test_resolve_bad_values_name_chunk_bytes(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_chunk_limit(value)  # type: ignore[arg-type]
    assert f"chunk_bytes={value!r}" in str(info.value)


# -- module boundaries ------------------------------------------------------------------------------


def _pinpool_imports(module: str, *, for_type_checkers: bool = False) -> set[str]:
    """The pinpool modules (and names) ``module`` imports when it loads: module-level imports, not
    those inside functions; with ``for_type_checkers``, those under ``if TYPE_CHECKING:`` too."""
    path = Path(__file__).resolve().parents[2] / "pinpool" / f"{module}.py"
    nodes: list[ast.stmt] = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            nodes += node.body if for_type_checkers else []
        else:
            nodes.append(node)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level:
            found |= {node.module or "", *(f"{node.module}.{a.name}" if node.module else a.name for a in node.names)}
    return found


def test_the_vocabulary_and_the_errors_import_nothing_of_pinpools() -> None:
    """Every layer imports the chunk vocabulary and the errors, so they import nothing back, not
    even for type checkers (that made a circle of six modules before the planner was split)."""
    assert _pinpool_imports("_plan/chunks", for_type_checkers=True) == set()
    assert _pinpool_imports("_errors", for_type_checkers=True) == set()


def test_planning_and_the_preflight_import_no_runtime_and_no_host_probe() -> None:
    """They receive HostFacts values and declared Capabilities, never read the host or name a runtime."""
    forbidden = {"runtimes", "_host", "_memlimits", "_libc", "testing"}
    for module in ("_plan/plan", "_plan/preflight", "_plan/calls"):
        imported = {name.split(".")[0] for name in _pinpool_imports(module)}
        assert not imported & forbidden, (module, imported & forbidden)
