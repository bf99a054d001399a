"""Reading command-line text: sizes, integers, shapes, seconds and nice levels, each failure a
ConfigError that names the flag and the fix. Torch-free, like everything ``--help`` imports."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from .._errors import ConfigError
from .._units import parse_size


def cli_size(option: str, text: str) -> int:
    """A size from the command line, stricter than :func:`parse_size`: a number without a unit
    counts bytes, so it must be whole (``1.5`` is a typo for ``1.5GiB``, not one byte)."""
    stripped = text.strip()
    example = f"e.g. {option} 64GiB"
    if stripped.startswith("-"):
        raise ConfigError(f"{option} {text}: a size must be positive; give {example}")
    number = stripped[:-1].rstrip() if stripped[-1:] in ("b", "B") else stripped
    try:
        value = Decimal(number)
    except InvalidOperation:
        return parse_size(text, what=option)  # has a unit (or is not a size): parse_size explains
    if value.is_finite() and value != value.to_integral_value():
        raise ConfigError(
            f"{option} {text} is not a whole number of bytes: a size without a unit counts bytes; "
            f"add a unit, e.g. {option} {number}GiB"
        )
    return parse_size(text, what=option)


def int_text(where: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{where} {text!r} is not an integer") from None


def shape_text(where: str, text: str) -> tuple[int, ...]:
    """``8,64,128`` as a shape."""
    return tuple(int_text(where, part) for part in text.split(",") if part.strip())


def codes_text(flag: str, text: str) -> tuple[int, ...]:
    """``--retry-codes``: ``1,2`` (checked by the pool), or ``none`` for no retry."""
    if text.strip().lower() == "none":
        return ()
    return tuple(int_text(flag, part.strip()) for part in text.split(",") if part.strip())


def seconds_text(flag: str, text: str) -> float | str | None:
    """``--max-call-seconds``: a number (checked by the pool), ``auto`` or ``none``."""
    word = text.strip().lower()
    if word in ("auto", "none"):
        return "auto" if word == "auto" else None
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{flag} {text}: give a number of seconds (e.g. 0.02), auto or none") from None


def nice_text(flag: str, text: str) -> int | str:
    """``--pin-nice``: an integer (checked by the pool) or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{flag} {text}: give an integer from 0 to 19, or auto") from None


def hold_seconds(text: str | None) -> float | None:
    """``--hold``: None for no hold, ``math.inf`` for forever, else seconds >= 0."""
    if text is None:
        return None
    if text.strip().lower() == "forever":
        return float("inf")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ConfigError(f"--hold {text}: give a number of seconds >= 0, or 'forever' (until Ctrl-C or SIGTERM)")
    return seconds
