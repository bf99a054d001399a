"""Byte sizes as users write them: ``4096``, ``"64GiB"``, ``"512MB"``, ``"1.5TiB"``."""

from __future__ import annotations

import re
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

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

_HINT = (
    'an integer byte count or a string such as "64GiB", "512MB" or "1.5TiB" '
    "(KiB/MiB/GiB/TiB are binary, kB/MB/GB/TB decimal)"
)


def parse_size(value: object, *, what: str = "size") -> int:
    """Return ``value`` as a positive whole number of bytes, or raise :class:`ConfigError`.

    Fractions are allowed when they come out to whole bytes' worth after rounding down
    (``"1.5GiB"``); the result must be at least one byte.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}={value!r} is a bool, not a size; give {_HINT}")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None:
            raise ConfigError(f"{what}={value!r} is not a size; give {_HINT}")
        number, unit = match.groups()
        multiplier = _UNITS.get(unit.lower())
        if multiplier is None:
            raise ConfigError(f"{what}={value!r} has unknown unit {unit!r}; give {_HINT}")
        try:
            parsed = Decimal(number)
        except InvalidOperation:  # an exponent beyond what Decimal can hold
            raise ConfigError(f"{what}={value!r} is out of range for a size; give {_HINT}") from None
        exact = decimal_to_int(parsed, multiplier)
        if exact is None:
            raise ConfigError(f"{what}={value!r} is too large to be a memory size; give {_HINT}")
        nbytes = exact
    else:
        raise ConfigError(f"{what}={value!r} has type {type(value).__name__}; give {_HINT}")
    if nbytes <= 0:
        raise ConfigError(f"{what}={value!r} is not positive; give {_HINT}")
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
    """Human-readable binary size for messages: ``2.5 GiB``, ``300 MiB``, ``17 B``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            text = f"{nbytes / scale:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
    return f"{nbytes} B"
