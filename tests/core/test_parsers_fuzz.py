"""Fuzzing what users type: sizes, environment variables, options, custom layouts. Whatever goes in,
the only exception out is ConfigError (bad input is never a TypeError, a ZeroDivisionError, an
OverflowError or a decimal.InvalidOperation), and what is accepted reads back sensibly."""

from __future__ import annotations

import inspect
import math
from decimal import Context, Decimal
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from pinpool import ConfigError, parse_size
from pinpool._cli import layout_from_file
from pinpool._plan import CHUNK_ENV, PoolOptions, chunk_limit_from_env
from pinpool._units import format_bytes, parse_env_gib
from pinpool.layouts import BufferSpec

from ..depth import depth, runs

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
EXACT = Context(prec=200)  # more digits than any accepted size has: products and quotients stay exact
UNITS = ["", "B", "k", "kB", "KiB", "M", "MB", "MiB", "G", "GB", "GiB", "T", "TB", "TiB", "P", "PB", "PiB"]

# Anything a caller might pass: text of every kind, numbers of every type, containers, None.
anything = st.one_of(
    st.text(),
    st.text(alphabet="0123456789.eE+-_ kKMGTPiB\t\n\u00a0\u2003١٠１０"),
    st.integers(),
    st.integers(min_value=-(2**2000), max_value=2**2000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.binary(max_size=20),
    st.decimals(allow_nan=True, allow_infinity=True),
    st.complex_numbers(),
    st.lists(st.integers(), max_size=3),
    st.tuples(st.integers()),
)
# Sizes spelled as users spell them, well-formed or nearly so.
size_texts = st.builds(
    lambda ws1, number, ws2, unit, ws3: f"{ws1}{number}{ws2}{unit}{ws3}",
    st.sampled_from(["", " ", "\t"]),
    st.from_regex(r"\A[0-9]{0,6}\.?[0-9]{0,6}([eE][+-]?[0-9]{1,3})?\Z"),
    st.sampled_from(["", " "]),
    st.sampled_from(UNITS),
    st.sampled_from(["", " ", "\n"]),
)
non_ascii_digits = st.characters(categories=["Nd"]).filter(lambda c: not c.isascii())
unicode_spaces = st.sampled_from(["\u00a0", "\u2000", "\u2003", "\u202f", "\u3000", "\x1c", "\x1d", "\x85", "\u200b"])


# -- parse_size ---------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(value=anything | size_texts)
@example(value="1_0GiB")
@example(value="١٠GiB")
@example(value="１０")
@example(value="1e999999999999999999")
@example(value=10**5000)
@example(value=float("nan"))
def test_parse_size_raises_only_config_error(value: object) -> None:
    try:
        result = parse_size(value)
    except ConfigError as error:
        assert str(error).startswith("size=")
        return
    assert type(result) is int and result >= 1
    if isinstance(value, str):  # accepted text is plain ASCII: digits, one point, exponent, a unit
        assert value.isascii() and "_" not in value
    else:
        assert type(value) is int and value == result


@depth
@settings(max_examples=runs(150, 500), deadline=None)
@given(text=size_texts, digit=non_ascii_digits, data=st.data())
def test_a_non_ascii_digit_anywhere_is_rejected(text: str, digit: str, data: st.DataObject) -> None:
    """Swap one ASCII digit of a size for a Unicode digit of the same value: never accepted."""
    positions = [i for i, c in enumerate(text) if c.isdigit()]
    assume(positions)
    i = data.draw(st.sampled_from(positions))
    with pytest.raises(ConfigError, match="is not an ASCII digit"):
        parse_size(text[:i] + digit + text[i + 1 :])


@settings(max_examples=300, deadline=None)
@given(text=size_texts, space=unicode_spaces, where=st.sampled_from(["start", "middle", "end"]))
def test_a_unicode_space_is_rejected(text: str, space: str, where: str) -> None:
    spelled = {"start": space + text, "end": text + space, "middle": text[:1] + space + text[1:]}[where]
    with pytest.raises(ConfigError, match="is not an ASCII digit, letter or space"):
        parse_size(spelled)


@settings(max_examples=400, deadline=None)
@given(n=st.integers(1, 2**62))
def test_sizes_round_trip(n: int) -> None:
    assert parse_size(n) == parse_size(str(n)) == parse_size(f"{n} B") == n
    # format_bytes rounds to two decimals of its unit: reading it back lands within that rounding.
    text = format_bytes(n)
    back = parse_size(text.replace(" ", ""))
    _number, unit = text.split(" ")
    scale = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": 1 << 40}[unit]
    assert abs(back - n) <= scale // 200 + 1
    exact = EXACT.divide(Decimal(n), Decimal(scale))  # n / 2**k has at most k decimals: exact
    assert parse_size(f"{exact}{unit if unit != 'B' else ''}") == n


@settings(max_examples=500, deadline=None)
@given(n=st.integers(0, 2**20), unit=st.sampled_from(UNITS[1:]), sep=st.sampled_from(["", " "]))
def test_units_scale_exactly(n: int, unit: str, sep: str) -> None:
    scale = parse_size(f"1{unit}")
    if n == 0:
        with pytest.raises(ConfigError, match="is not positive"):
            parse_size(f"{n}{sep}{unit}")
    else:
        assert parse_size(f"{n}{sep}{unit}") == n * scale


# -- environment variables -------------------------------------------------------------------------------------


env_texts = st.one_of(
    st.text(),
    st.text(alphabet="0123456789.eE+-_ \t\n\u00a0١٠１０"),
    st.from_regex(r"\A\s*[0-9]{0,8}\.?[0-9]{0,8}([eE][+-]?[0-9]{1,4})?\s*\Z"),
    st.decimals(allow_nan=True, allow_infinity=True).map(str),
    st.floats().map(repr),
    st.integers(-(2**80), 2**80).map(str),
)


@settings(max_examples=300, deadline=None)
@given(raw=env_texts)
@example(raw="1_0")
@example(raw="١٠")
@example(raw="１０")
@example(raw=" 1 0 ")
@example(raw="+1")
@example(raw="1e99999999999999999999")
def test_env_gib_raises_only_config_error(raw: str) -> None:
    try:
        nbytes = parse_env_gib("PINPOOL_X_GB", raw, default_gib=256)
    except ConfigError as error:
        message = str(error)
        assert message.startswith(f"PINPOOL_X_GB={raw!r} ") and "unset it for the default 256" in message
        return
    assert type(nbytes) is int and nbytes >= 1
    assert raw.isascii() and "_" not in raw and raw.strip()[0] not in "+-"
    assert nbytes == math.floor(EXACT.multiply(Decimal(raw.strip()), Decimal(GiB)))


@settings(max_examples=500, deadline=None)
@given(gib=st.integers(1, 2**40) | st.decimals(min_value=Decimal("1e-9"), max_value=Decimal(10**9), places=9))
def test_env_gib_round_trips(gib: int | Decimal) -> None:
    nbytes = math.floor(EXACT.multiply(Decimal(gib), Decimal(GiB)))
    if nbytes == 0:
        with pytest.raises(ConfigError, match="is less than one byte"):
            parse_env_gib("PINPOOL_X_GB", str(gib), default_gib=1)
    else:
        assert parse_env_gib("PINPOOL_X_GB", str(gib), default_gib=1) == nbytes


@settings(max_examples=500, deadline=None)
@given(raw=env_texts)
def test_the_chunk_env_var_raises_only_config_error(raw: str) -> None:
    try:
        limit = chunk_limit_from_env({CHUNK_ENV: raw})
    except ConfigError as error:
        assert str(error).startswith(f"{CHUNK_ENV}={raw!r} ")
    else:
        assert type(limit) is int and limit >= 1


# -- options and custom layouts ------------------------------------------------------------------------------

_CREATE = inspect.signature(PoolOptions.create).parameters


@depth
@settings(max_examples=runs(100, 300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_pool_options_raise_only_config_error(data: st.DataObject) -> None:
    """Every option of PoolOptions.create (whatever fields it has today), junk or plausible."""
    plausible: dict[str, st.SearchStrategy[Any]] = {
        "size": size_texts | st.integers(-10, 2**50),
        "chunk_bytes": st.none() | size_texts | st.integers(-10, 2**40),
        "min_chunk_bytes": size_texts | st.integers(-10, 2**40),
        "populate": st.none() | st.booleans(),
        "huge_pages": st.sampled_from([False, True, "hugetlb", "thp", 1, None]),
        "name": st.text(max_size=8),
        "max_retries": st.integers(-3, 10),
    }
    kwargs: dict[str, object] = {"size": data.draw(plausible["size"] | anything, label="size")}
    for name in _CREATE:
        if name in ("size", "layout") or not data.draw(st.booleans(), label=f"set {name}"):
            continue
        kwargs[name] = data.draw(plausible.get(name, st.none() | st.integers(-3, 64)) | anything, label=name)
    try:
        options = PoolOptions.create(**kwargs)  # type: ignore[arg-type]
    except ConfigError:
        return
    assert options.size >= 1 and options.chunk_limit >= 1


class JunkLayout:
    """A custom layout answering with whatever hypothesis drew (or raising it)."""

    def __init__(self, name: object, page_bytes: object, buffers: object) -> None:
        self._name, self._page_bytes, self._buffers = name, page_bytes, buffers

    @property
    def name(self) -> Any:
        return self._answer(self._name)

    @property
    def page_bytes(self) -> Any:
        return self._answer(self._page_bytes)

    def buffers(self, num_pages: int) -> Any:
        answer = self._answer(self._buffers)
        return answer(num_pages) if callable(answer) else answer

    @staticmethod
    def _answer(value: object) -> object:
        if isinstance(value, BaseException):
            raise value
        return value


errors = st.sampled_from([ZeroDivisionError("division by zero"), ValueError("bad"), KeyError("k"), TypeError("t")])
dtypes = st.sampled_from([torch.uint8, torch.bfloat16, torch.float32, "uint8", None])
specs = st.builds(
    BufferSpec,
    name=st.sampled_from(["data", "k", "v", "", 3]),
    shape=st.one_of(
        st.tuples(st.integers(-2, 5000)), st.tuples(st.integers(0, 64), st.integers(0, 64)), st.just([4096])
    ),
    dtype=dtypes,
    granularity=st.none() | st.integers(-1, 8192) | st.just(True) | st.just(1.5),
)
buffer_answers = st.one_of(
    errors,
    st.none(),
    st.integers(),
    st.text(max_size=3),
    st.lists(specs, max_size=3).map(tuple),
    st.lists(specs | st.integers(), max_size=3),
    st.just(lambda n: (BufferSpec("data", (n * 4096,), torch.uint8, None),)),
    st.just(lambda n: (BufferSpec("data", (n,), torch.uint8, 0),)),
    st.just(lambda n: 1 // 0),
    st.just(lambda n: iter(())),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["mine", "", None, 7]) | errors,
    page_bytes=st.one_of(
        st.integers(-5, 1 << 20), st.just(0), st.booleans(), st.floats(), st.none(), st.text(max_size=2), errors
    ),
    buffers=buffer_answers,
    size=st.integers(1, 1 << 30),
)
@example(name="mine", page_bytes=0, buffers=(), size=GiB)  # once a ZeroDivisionError in the plan
def test_custom_layouts_raise_only_config_error(name: object, page_bytes: object, buffers: object, size: int) -> None:
    layout = JunkLayout(name, page_bytes, buffers)
    try:
        options = PoolOptions.create(layout=layout, size=size)  # type: ignore[arg-type]
    except ConfigError as error:
        assert "layout" in str(error) or "size=" in str(error)
        return
    assert isinstance(options.layout.page_bytes, int) and options.layout.page_bytes >= 1


# json's decoder recurses once per bracket: 100,000 of them (100 kB, under the 1 MiB limit) were a RecursionError.
@pytest.mark.parametrize(
    "text",
    ["[" * 100_000, "[" * 1_000 + "]" * 1_000, '{"family": "mha", "layer_num": ' + "[" * 5_000 + "]" * 5_000 + "}",
     '{"family": "raw", "x": ' + '{"a": ' * 50_000 + "1" + "}" * 50_001],
)  # fmt: skip
def test_a_deeply_nested_layout_file_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "layout.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="nests too deeply"):
        layout_from_file(str(path))
