"""Byte sizes: `parse_size` and `format_bytes`; numbers from environment variables: `parse_env_gib`."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pinpool import ConfigError, parse_size
from pinpool._plan import CHUNK_ENV, chunk_limit_from_env
from pinpool._units import format_bytes, parse_env_gib

KiB, MiB, GiB, TiB, PiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40, 1 << 50

BINARY = {"KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB, "PiB": PiB}
DECIMAL = {
    "k": 10**3,
    "kB": 10**3,
    "M": 10**6,
    "MB": 10**6,
    "G": 10**9,
    "GB": 10**9,
    "T": 10**12,
    "TB": 10**12,
    "P": 10**15,
    "PB": 10**15,
}


# -- accepted ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1, 4096, 2**40, 2**50 + 3])
def test_int_passes_through(value: int) -> None:
    result = parse_size(value)
    assert result == value
    assert type(result) is int


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64GiB", 64 * GiB),
        ("512MB", 512 * 10**6),
        ("512MiB", 512 * MiB),
        ("1.5TiB", 3 * (TiB // 2)),
        ("4k", 4000),
        ("4KiB", 4096),
        (" 2 GiB ", 2 * GiB),
        ("2 GiB", 2 * GiB),
        ("\t8\tMiB\n", 8 * MiB),
        ("17", 17),
        ("17B", 17),
        ("17 b", 17),
        ("0.5KiB", 512),
        (".5KiB", 512),
        ("1.5", 1),  # fractions of a byte round down
        ("2.9B", 2),
        ("1e3", 1000),
        ("1E2KiB", 100 * KiB),
        ("1PiB", PiB),
    ],
)
def test_strings(text: str, expected: int) -> None:
    result = parse_size(text)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    "text",
    ["64GiB", "64gib", "64GIB", "64gIb", "64 Gib"],
)
def test_units_are_case_insensitive(text: str) -> None:
    assert parse_size(text) == 64 * GiB


@pytest.mark.parametrize(("text", "expected"), [("512mb", 512 * 10**6), ("512MB", 512 * 10**6), ("512Mb", 512 * 10**6)])
def test_decimal_units_case_insensitive(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_binary_and_decimal_differ() -> None:
    assert parse_size("1GiB") == 2**30
    assert parse_size("1GB") == 10**9
    assert parse_size("1G") == 10**9
    assert parse_size("1KB") == 1000
    assert parse_size("1KiB") == 1024


# -- rejected -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (True, "is a bool"),
        (False, "is a bool"),
        (1.5, "has type float"),
        (4096.0, "has type float"),
        (None, "has type NoneType"),
        (b"4096", "has type bytes"),
        (-1, "is not positive"),
        (0, "is not positive"),
        ("0", "is not positive"),
        ("0GiB", "is not positive"),
        ("0.1B", "is not positive"),  # rounds down to zero bytes
        ("", "is not a size"),
        ("   ", "is not a size"),
        ("GiB", "is not a size"),
        ("1.2.3", "is not a size"),
        ("-1", "is not a size"),
        ("-1GiB", "is not a size"),
        ("+1GiB", "is not a size"),
        ("1 2 GiB", "is not a size"),
        ("5.", "is not a size"),
        ("0x10", "is not a size"),
        ("12XB", "has unknown unit 'XB'"),
        ("12 GiBs", "has unknown unit 'GiBs'"),
        ("1 Gi", "has unknown unit 'Gi'"),
    ],
)
def test_rejected(value: object, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(value)
    message = str(info.value)
    assert message.startswith(f"size={value!r} ")
    assert why in message
    assert '"64GiB"' in message  # what to write instead


# Python's own parsers take all of these (int("1_0"), Decimal("١٠"), " 2".strip() of U+00A0): a size
# must not. Each is a typo or a paste accident, reported with the character it found.
NOT_ASCII = [
    ("1_0", "digit separators '_' are not accepted"),
    ("1_0GiB", "digit separators '_' are not accepted"),
    ("١٠", "'١', U+0661, is not an ASCII digit"),  # Arabic-Indic
    ("١٠GiB", "U+0661"),
    ("１０", "'１', U+FF11, is not an ASCII digit"),  # fullwidth
    ("１０GiB", "U+FF11"),
    ("𝟏𝟎", "U+1D7CF"),  # mathematical bold
    ("\u00a02GiB", "U+00A0"),  # no-break space
    ("2\u2003GiB", "U+2003"),  # em space
    ("2GiB\u200b", "U+200B"),  # zero-width space
    ("2\x1cGiB", "U+001C"),  # str.strip() strips this one
    ("2\x00", "U+0000"),
    ("2ＧiB", "U+FF27"),  # a fullwidth unit letter
]


@pytest.mark.parametrize(("text", "why"), NOT_ASCII)
def test_only_ascii_sizes(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(text)
    message = str(info.value)
    assert message.startswith(f"size={text!r} is not a size")
    assert why in message and '"64GiB"' in message


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("lots")


@pytest.mark.parametrize("value", [0, "nope", 1.0, True, "3 XB"])
def test_message_uses_what_label(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(value, what="chunk_bytes")
    message = str(info.value)
    assert f"chunk_bytes={value!r}" in message
    assert "size=" not in message.split(";")[0]


@pytest.mark.parametrize(
    "text",
    ["1e999999", "1e999999KiB", "1e1000000GiB", "1e31", "1" + "0" * 31, "1e16PiB", "9" * 5000],
)
def test_absurdly_large_sizes_are_config_errors(text: str) -> None:
    # once overflowed the default Decimal context (decimal.Overflow), or built a huge int
    with pytest.raises(ConfigError) as info:
        parse_size(text, what="chunk_bytes")
    assert str(info.value).startswith(f"chunk_bytes={text!r} is too large to be a memory size")


@pytest.mark.parametrize(
    "text",
    [
        "12345678901234567890123456789",  # 29 significant digits: more than the default 28-digit context
        "1267650600228229401496703205376",  # 2**100: "far beyond any memory", still accepted
        "1000000000000000000000000000000",  # 10**30
    ],
)
def test_long_integer_strings_are_exact(text: str) -> None:
    assert parse_size(text) == int(text)


def test_fractions_round_down_exactly() -> None:
    # 29 nines: a 28-digit context would round this up to 1 byte
    with pytest.raises(ConfigError, match="is not positive"):
        parse_size("0." + "9" * 29)
    assert parse_size("1." + "9" * 40) == 1
    assert parse_size("1.5e-9GiB") == 1  # 1.61 bytes
    with pytest.raises(ConfigError, match="is not positive"):
        parse_size("0." + "0" * 1000 + "1TiB")


@pytest.mark.parametrize("text", ["0e31", "0.0e40GiB", "0e999999"])
def test_zero_with_large_exponent_is_not_positive(text: str) -> None:
    with pytest.raises(ConfigError, match="is not positive"):
        parse_size(text)


@pytest.mark.parametrize("text", ["1e99999999999999999999", "1e-99999999999999999999KiB"])
def test_out_of_range_exponent_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="size="):
        parse_size(text)


# -- properties -------------------------------------------------------------------------------------


@given(st.integers(1, 2**50))
def test_round_trip_bytes(n: int) -> None:
    assert parse_size(n) == n
    assert parse_size(str(n)) == n
    assert parse_size(f"{n}B") == n
    assert parse_size(f" {n} b ") == n


@given(st.integers(1, 2**20), st.sampled_from(sorted(BINARY.items()) + sorted(DECIMAL.items())))
def test_units_multiply(n: int, unit: tuple[str, int]) -> None:
    name, scale = unit
    assert parse_size(f"{n}{name}") == n * scale
    assert parse_size(f"{n} {name.upper()}") == n * scale


@given(st.integers(0, 2**20), st.sampled_from(sorted(BINARY.items())))
def test_half_units(n: int, unit: tuple[str, int]) -> None:
    name, scale = unit
    assert parse_size(f"{n}.5{name}") == n * scale + scale // 2


ALL_UNITS = sorted({**BINARY, **DECIMAL, "": 1, "B": 1}.items())


@given(
    whole=st.text("0123456789", max_size=35),
    frac=st.text("0123456789", max_size=35),
    exponent=st.none() | st.integers(-60, 60),
    unit=st.sampled_from(ALL_UNITS),
)
def test_decimal_strings_are_exact_floor_or_config_error(
    whole: str, frac: str, exponent: int | None, unit: tuple[str, int]
) -> None:
    if not (whole or frac):
        whole = "0"
    number = f"{whole}.{frac}" if frac else whole
    if exponent is not None:
        number += f"e{exponent}"
    name, scale = unit
    exact = Fraction(whole + frac or "0") / 10 ** len(frac) * scale * Fraction(10) ** (exponent or 0)
    text = f"{number}{name}"
    try:
        result = parse_size(text)
    except ConfigError as exc:
        message = str(exc)
        if exact == 0:
            pass  # rejected, as it must be; the message is wrong for 0eNN (see test_zero_with_large_exponent)
        elif "too large" in message:
            assert exact >= 10**31  # the cut-off lies well beyond 2**100 bytes
        else:
            assert "is not positive" in message
            assert exact < 1
    else:
        assert result == math.floor(exact)
        assert 1 <= result < 10**32


@given(st.text(max_size=40) | st.from_regex(r"\A\s*[0-9.]{0,12}([eE][+-]?[0-9]{1,6})?\s*[A-Za-z]{0,4}\s*\Z"))
def test_any_string_is_a_size_or_a_config_error(text: str) -> None:
    try:
        result = parse_size(text)
    except ConfigError as exc:
        assert str(exc).startswith(f"size={text!r} ")
    else:
        assert isinstance(result, int)
        assert result >= 1


@given(st.integers(-(2**60), 0))
def test_non_positive_ints_rejected(n: int) -> None:
    with pytest.raises(ConfigError, match="is not positive"):
        parse_size(n)


# -- format_bytes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (17, "17 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (61440, "60 KiB"),
        (300 * MiB, "300 MiB"),
        (900 * MiB, "900 MiB"),
        (2500 * MiB, "2.44 GiB"),
        (5 * GiB // 2, "2.5 GiB"),
        (256 * GiB, "256 GiB"),
        (TiB, "1 TiB"),
        (3 * TiB // 2, "1.5 TiB"),
        (PiB, "1024 TiB"),
    ],
)
def test_format_bytes(nbytes: int, text: str) -> None:
    assert format_bytes(nbytes) == text


@given(st.integers(0, 2**60))
@example(12160)  # 11.875 KiB: an exact half, rounds to 11.88
def test_format_bytes_reads_back_within_rounding(n: int) -> None:
    text = format_bytes(n)
    number, unit = text.split(" ")
    assert unit in {"B", "KiB", "MiB", "GiB", "TiB"}
    assert not number.endswith((".", "0")) or "." not in number  # trailing zeros stripped
    if unit == "B":
        assert int(number) == n
    else:
        scale = BINARY[unit]
        assert n >= scale  # never "0.5 GiB": the largest unit that fits
        assert abs(Fraction(number) * scale - n) <= Fraction(5, 1000) * scale  # two decimals, rounded


# -- environment variables: parse_env_gib (PINPOOL_REGISTER_CHUNK_GB) --------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("64", 64 * GiB),
        ("0.5", 512 * MiB),
        (".5", 512 * MiB),
        ("5.", 5 * GiB),
        (" 2 ", 2 * GiB),
        ("\t2\n", 2 * GiB),  # a YAML block scalar ends in a newline
        ("2.5E1", 25 * GiB),
        ("1e21", 10**21 << 30),
        ("0." + "9" * 40, GiB - 1),  # rounded down, exactly
    ],
)
def test_env_gib_accepted(raw: str, expected: int) -> None:
    assert parse_env_gib("PINPOOL_X_GB", raw, default_gib=7) == expected


ENV_REJECTED = [
    ("", "is not a number"),
    ("   ", "is not a number"),
    ("abc", "is not a number"),
    ("64GiB", "is not a number"),
    ("1 0", "is not a number"),
    ("0x10", "is not a number"),
    ("1.2.3", "is not a number"),
    ("1_0", "is not a number (digit separators '_' are not accepted)"),
    ("١٠", "is not a number ('١', U+0661, is not an ASCII digit"),
    ("１０", "is not a number ('１', U+FF11, is not an ASCII digit"),
    ("\u00a02", "U+00A0"),
    ("2\u2003", "U+2003"),
    ("-1", "must be a positive, finite number"),
    ("+1", "must be a positive, finite number"),
    ("-0.5", "must be a positive, finite number"),
    ("nan", "must be a positive, finite number"),
    ("NaN", "must be a positive, finite number"),
    ("inf", "must be a positive, finite number"),
    ("-inf", "must be a positive, finite number"),
    ("Infinity", "must be a positive, finite number"),
    ("0", "must be a positive, finite number of GiB"),
    ("0.0e5", "must be a positive, finite number of GiB"),
    ("1e-12", "is less than one byte"),
    ("1e22", "is too large to be a memory size"),
    ("9" * 5000, "is too large to be a memory size"),
    ("1e99999999999999999999", "is not a number (its exponent is out of range)"),
]


@pytest.mark.parametrize(("raw", "why"), ENV_REJECTED)
def test_env_gib_rejected_naming_the_variable_the_value_and_the_fix(raw: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_env_gib("PINPOOL_X_GB", raw, default_gib=7)
    message = str(info.value)
    assert message.startswith(f"PINPOOL_X_GB={raw!r} ")
    assert why in message
    assert message.endswith(
        "; set PINPOOL_X_GB to a positive number of GiB (e.g. 64 or 0.5), or unset it for the default 7"
    )


@pytest.mark.parametrize(("raw", "why"), ENV_REJECTED)
def test_the_chunk_env_var_is_parsed_strictly(raw: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        chunk_limit_from_env({CHUNK_ENV: raw})
    assert str(info.value).startswith(f"{CHUNK_ENV}={raw!r} ") and why in str(info.value)
