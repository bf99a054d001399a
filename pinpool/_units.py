"""Byte sizes as users write them (``"64GiB"``), numbers from environment variables, and sizes and
rates as messages print them. Only ASCII spellings are accepted: ``int()`` and ``Decimal()`` take
``"1_0"``, non-ASCII digits and Unicode spaces, which in a config file or a shell are typos to report.
"""

from __future__ import annotations

import math
import re
import shlex
from decimal import Decimal, InvalidOperation, localcontext

from ._errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
    "p": 1000**5, "pb": 1000**5, "pib": 1 << 50,
}  # fmt: skip

# re.ASCII: \s is ASCII whitespace only (never U+00A0 and friends); [0-9] and [A-Za-z] are ASCII anyway.
_SIZE_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", re.ASCII)
# A plain number as environment variables hold it: digits, one point, an optional exponent.
_NUMBER_RE = re.compile(r"\s*(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*", re.ASCII)

_UNITS_NOTE = "KiB/MiB/GiB/TiB are binary, kB/MB/GB/TB decimal"


def size_error(what: str, value: object, problem: str, fix: str | None = None) -> ConfigError:
    """Every size error in one style: the value as written, what is wrong, the fix in the caller's spelling:
    a flag (``what="--size"``) as a shell takes it (``--size '5 GB'``), a keyword as Python shows it (``size=0``)."""
    flag = what.startswith("--") and " " not in what
    typed = shlex.quote(value) if isinstance(value, str) else value
    named = f"{what} {typed}" if flag else f"{what}={shown(value)}"
    if fix is None and flag:
        fix = f"give a size such as {what} 64GiB, 512MB or 1.5TiB ({_UNITS_NOTE})"
    elif fix is None:
        fix = f'give an integer byte count or a string such as "64GiB", "512MB" or "1.5TiB" ({_UNITS_NOTE})'
    return ConfigError(f"{named} {problem}; {fix}")


def parse_size(value: object, *, what: str = "size") -> int:
    """``value`` as a positive whole number of bytes (fractions round down: ``"1.5GiB"``), or :class:`ConfigError`."""
    if isinstance(value, bool):
        raise size_error(what, value, "is a bool, not a size")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, str):
        match = _SIZE_RE.fullmatch(value)
        if match is None:
            raise size_error(what, value, f"is not a size{_oddity(value)}")
        number, unit = match.groups()
        multiplier = _UNITS.get(unit.lower())
        if multiplier is None:
            raise size_error(what, value, f"has unknown unit {unit!r}")
        try:
            parsed = Decimal(number)
        except InvalidOperation:  # an exponent beyond what Decimal can hold
            raise size_error(what, value, "is out of range for a size") from None
        exact = decimal_to_int(parsed, multiplier)
        if exact is None:
            raise size_error(what, value, "is too large to be a memory size")
        nbytes = exact
    else:
        raise size_error(what, value, f"has type {type(value).__name__}, not int or str")
    if nbytes <= 0:
        raise size_error(what, value, "is not positive")
    return nbytes


def shown(value: object) -> str:
    """``repr(value)`` for messages; ints too long for ``str()`` (its digit limit) as ``~2**N``."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"{'-' if value < 0 else ''}~2**{value.bit_length() - 1}"
    return repr(value)


def _oddity(text: str) -> str:
    """Why a rejected string may have looked right: a non-ASCII character or a digit separator."""
    odd = next((c for c in text if not c.isascii() or (not c.isprintable() and c not in " \t\n")), None)
    if odd is not None:
        return f" ({odd!r}, U+{ord(odd):04X}, is not an ASCII digit, letter or space)"
    if "_" in text:
        return " (digit separators '_' are not accepted)"
    return ""


def ascii_decimal(raw: str, *, what: str, fix: str, given: object = None) -> Decimal:
    """An environment variable's ASCII number (``2.5E1``) as a non-negative Decimal, or a ConfigError naming
    ``what=value`` and ``fix``; ``given``: the whole value when ``raw`` is a part of it (``"80"`` of ``"80%"``)."""
    shown = raw if given is None else given
    if not _NUMBER_RE.fullmatch(raw):
        word = raw.strip(" \t\n\r\f\v").lower()
        if word[:1] in ("-", "+") or word in ("nan", "inf", "infinity", "snan"):
            raise ConfigError(f"{what}={shown!r} must be a positive, finite number{_oddity(raw)}; {fix}")
        raise ConfigError(f"{what}={shown!r} is not a number{_oddity(raw)}; {fix}")
    try:
        return Decimal(raw.strip())  # only ASCII whitespace is left to strip: the pattern matched
    except InvalidOperation:  # an exponent beyond what Decimal can hold
        raise ConfigError(f"{what}={shown!r} is not a number (its exponent is out of range); {fix}") from None


def parse_env_gib(name: str, raw: str, *, default_gib: int) -> int:
    """An environment variable holding GiB (fractions allowed) as whole bytes, rounded down, or :class:`ConfigError`."""
    fix = f"set {name} to a positive number of GiB (e.g. 64 or 0.5), or unset it for the default {default_gib}"
    gib = ascii_decimal(raw, what=name, fix=fix)
    if gib <= 0:
        raise ConfigError(f"{name}={raw!r} must be a positive, finite number of GiB; {fix}")
    nbytes = decimal_to_int(gib, 1 << 30)
    if nbytes is None:
        raise ConfigError(f"{name}={raw!r} is too large to be a memory size; {fix}")
    if nbytes <= 0:
        raise ConfigError(f"{name}={raw!r} is less than one byte; {fix}")
    return nbytes


# Far beyond any memory (2**100 bytes), small enough that exact arithmetic stays cheap.
_MAX_DIGITS = 31


def decimal_to_int(number: Decimal, multiplier: int) -> int | None:
    """``floor(number * multiplier)`` computed exactly, or None when it is absurdly large."""
    if number.is_zero():
        return 0
    if not number.is_finite() or number.adjusted() + len(str(multiplier)) > _MAX_DIGITS:
        return None
    with localcontext() as ctx:
        ctx.prec = 2 * _MAX_DIGITS + len(number.as_tuple().digits)
        return int(number * multiplier)


def format_bytes(nbytes: int) -> str:
    """A size for messages, in binary units: ``2.5 GiB``, ``300 MiB``, ``17 B``; ``~2**N B`` past
    2**1000 B, which no float holds."""
    if nbytes.bit_length() > 1000:
        return f"~2**{nbytes.bit_length() - 1} B"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            text = f"{nbytes / scale:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
    return f"{nbytes} B"


def human(nbytes: int) -> str:
    """:func:`format_bytes` for a figure a message computed: ``about 2**N B`` past 2**128 B (an overflow)."""
    return format_bytes(nbytes) if nbytes.bit_length() <= 128 else f"about 2**{nbytes.bit_length() - 1} B"


def bytes_text(nbytes: int) -> str:
    """A size as a message names a value it was given: ``3221225472 B = 3 GiB`` (:func:`human` past 2**128)."""
    return f"{nbytes} B = {format_bytes(nbytes)}" if nbytes.bit_length() <= 128 else human(nbytes)


def format_rate(nbytes: float | None, seconds: float = 1.0) -> str:
    """Decimal GB/s, as pinpool reports throughput: ``5.21 GB/s``; ``-- GB/s`` when unknown."""
    if nbytes is None or seconds <= 0 or not math.isfinite(nbytes / seconds):
        return "-- GB/s"
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


# huge_pages= spellings that map hugetlb pages, and the page each maps: plain "hugetlb" keeps its
# first meaning (2 MiB pages, vm.nr_hugepages); "hugetlb:1GiB" takes pages reserved at boot.
HUGETLB_PAGE_SIZES = {"hugetlb": 2 << 20, "hugetlb:2MiB": 2 << 20, "hugetlb:1GiB": 1 << 30}


def hugetlb_page_size(huge_pages: object) -> int:
    """The hugetlb page ``huge_pages=`` maps with (2 MiB or 1 GiB); 0 for False and True (THP)."""
    return HUGETLB_PAGE_SIZES.get(huge_pages, 0) if isinstance(huge_pages, str) else 0
