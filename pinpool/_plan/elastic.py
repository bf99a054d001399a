"""The elastic policy (pure: no I/O, no clock; time is an input): from one :class:`MemoryReading` and
the pool's state, whether to grow, shrink or hold, and why, in one line for the event log.

- **Shrink under pressure**, one ``step`` at a time, never below the floor: pressure is PSI ``some``
  avg10 at or above ``shrink_psi``, or the working set (usage less page cache, which the kernel drops
  before any OOM kill) at or above ``shrink_used`` of a limit: the memory cgroup's limit, its
  ``memory.high`` / v1 soft limit (giving back before the kernel throttles), or the host's MemTotal
  (MemAvailable). A shrink that reaches the floor is its own action, ``shrink_to_floor``: the pool has
  nothing left to give, an operator should hear of it. Successive shrinks are ``shrink_interval_seconds``
  apart, since PSI's 10 s average lags a shrink by seconds.
- **Grow** only when calm (every signal below its ``calm_*`` threshold: the band between calm and
  pressure holds, so readings that wander around one threshold cannot flap), not within
  ``cooldown_seconds`` of a shrink, and only on the server's ask or, opted in (``grow_while_free``), by
  one step while memory is free. A grow keeps ``headroom`` free (vllm#42632 asks for about 20 %) and
  never takes a limit's use past ``calm_used``, so a grow alone cannot make the next reading pressure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

from .._errors import ConfigError
from .._types import MemoryReading

__all__ = ["Action", "Decision", "ElasticPolicy", "ElasticState", "decide"]


class Action(StrEnum):
    GROW = "grow"
    SHRINK = "shrink"
    SHRINK_TO_FLOOR = "shrink_to_floor"  # a shrink that leaves the pool at its floor: alert on it
    HOLD = "hold"


def _number(name: str, value: object, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"ElasticPolicy {name}={value!r}: {fix}")
    return float(value)


def _bytes(owner: str, name: str, value: object, *, positive: bool = False) -> int:
    if type(value) is not int or value < (1 if positive else 0):
        least = "a positive" if positive else "a non-negative"
        raise ConfigError(f"{owner} {name}={value!r}: use {least} whole number of bytes")
    return value


@dataclass(frozen=True)
class ElasticPolicy:
    """When an elastic pool grows and shrinks (module docstring). Bytes are whole numbers; the caller
    rounds ``step`` to whole chunks. ``headroom``: a float below 1 is a fraction of the binding limit (the
    cgroup's, else MemTotal), an int is bytes. Thresholds: PSI in percent, ``*_used`` as fractions."""

    floor: int = 0
    step: int = 1 << 30
    headroom: float | int = 0.2
    grow_while_free: bool = False
    shrink_psi: float = 10.0
    calm_psi: float = 1.0
    shrink_used: float = 0.90
    calm_used: float = 0.75
    cooldown_seconds: float = 30.0
    shrink_interval_seconds: float = 2.0
    # How often a pool's loop reads pressure between the kernel's notifications (calm comes without one).
    read_interval_seconds: float = 1.0

    def __post_init__(self) -> None:
        _bytes("ElasticPolicy", "floor", self.floor)
        _bytes("ElasticPolicy", "step", self.step, positive=True)
        if type(self.headroom) is float:
            if not 0.0 <= self.headroom < 1.0:
                raise ConfigError(
                    f"ElasticPolicy headroom={self.headroom!r}: a fraction of memory to keep free is from 0.0 to "
                    "below 1.0 (0.2: keep 20 % free); give bytes as an int"
                )
        else:
            _bytes("ElasticPolicy", "headroom", self.headroom)
        if type(self.grow_while_free) is not bool:
            raise ConfigError(f"ElasticPolicy grow_while_free={self.grow_while_free!r}: use True or False")
        shrink_psi = _number("shrink_psi", self.shrink_psi, "use a PSI some avg10 percentage above 0, up to 100")
        if not 0 < shrink_psi <= 100:
            raise ConfigError(f"ElasticPolicy shrink_psi={self.shrink_psi!r}: use a percentage above 0, up to 100")
        calm_psi = _number("calm_psi", self.calm_psi, "use a percentage below shrink_psi")
        if calm_psi >= shrink_psi:
            raise ConfigError(
                f"ElasticPolicy calm_psi={self.calm_psi!r} is not below shrink_psi={self.shrink_psi!r}: without a "
                "band between them the pool would grow and shrink on every wobble; use a lower calm_psi"
            )
        shrink_used = _number("shrink_used", self.shrink_used, "use a fraction above 0, up to 1")
        if not 0 < shrink_used <= 1:
            raise ConfigError(f"ElasticPolicy shrink_used={self.shrink_used!r}: use a fraction above 0, up to 1")
        if _number("calm_used", self.calm_used, "use a fraction below shrink_used") >= shrink_used:
            raise ConfigError(
                f"ElasticPolicy calm_used={self.calm_used!r} is not below shrink_used={self.shrink_used!r}: without "
                "a band between them the pool would grow and shrink on every wobble; use a lower calm_used"
            )
        _number("cooldown_seconds", self.cooldown_seconds, "use a finite number of seconds, 0 or more")
        _number("shrink_interval_seconds", self.shrink_interval_seconds, "use a finite number of seconds, 0 or more")
        if (
            not 0
            < _number("read_interval_seconds", self.read_interval_seconds, "use a number of seconds above 0")
            <= 60
        ):
            raise ConfigError(
                f"ElasticPolicy read_interval_seconds={self.read_interval_seconds!r}: use seconds above 0, up to 60 "
                "(1.0: a reading costs a few file reads)"
            )

    def check(self, reserved: int) -> None:
        """A pool reserving ``reserved`` bytes can follow this policy (call it when the pool is made)."""
        if self.floor > reserved:
            raise ConfigError(
                f"ElasticPolicy floor={self.floor} is above the pool's reservation of {reserved} bytes: the pool "
                "could never pin its floor; lower the floor or reserve more"
            )


@dataclass(frozen=True)
class ElasticState:
    """An elastic pool as the policy sees it: bytes ``reserved`` (the most it can pin) and ``pinned``;
    ``pinned_floor``: bytes it cannot give back now whatever the policy's floor (the server's in-use
    pages, as it last said); when it last grew and shrank (the caller's clock, seconds)."""

    reserved: int
    pinned: int
    pinned_floor: int = 0
    last_grow_at: float | None = None
    last_shrink_at: float | None = None

    def __post_init__(self) -> None:
        for name in ("reserved", "pinned", "pinned_floor"):
            _bytes("ElasticState", name, getattr(self, name))
        if self.pinned > self.reserved:
            raise ConfigError(
                f"ElasticState pinned={self.pinned} is above reserved={self.reserved}: a pool pins only what it "
                "reserved; pass the pool's own figures"
            )

    def after(self, decision: Decision, now: float, done: int | None = None) -> ElasticState:
        """The state once ``decision`` was carried out at ``now``: ``done`` bytes of it (default: all;
        a server may give back fewer pages than asked)."""
        nbytes = decision.nbytes if done is None else done
        if decision.action is Action.GROW:
            return replace(self, pinned=min(self.reserved, self.pinned + nbytes), last_grow_at=now)
        if decision.action is Action.HOLD:
            return self
        return replace(self, pinned=max(0, self.pinned - nbytes), last_shrink_at=now)


@dataclass(frozen=True)
class Decision:
    """What to do: ``action`` by ``nbytes`` (0 for hold), ``reason`` (one line, for the event log),
    ``pressure`` (pressure was seen), ``at_floor`` (under pressure with nothing more to give back)."""

    action: Action
    nbytes: int
    reason: str
    pressure: bool = False
    at_floor: bool = False


@dataclass(frozen=True)
class _Scope:
    """One limit the working set lives under: its name, bytes in use and the limit."""

    name: str
    used: int
    limit: int

    @property
    def free(self) -> int:
        return max(0, self.limit - self.used)


def _scopes(reading: MemoryReading) -> list[_Scope]:
    scopes = []
    working_set = reading.working_set_bytes
    if working_set is not None:
        for name, limit in (("memory limit", reading.limit_bytes), ("memory.high", reading.high_bytes)):
            if limit:
                scopes.append(_Scope(f"cgroup {name}", working_set, limit))
    total, available = reading.mem_total_bytes, reading.mem_available_bytes
    if total and available is not None:
        scopes.append(_Scope("host memory", max(0, total - available), total))
    return scopes


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


def decide(
    policy: ElasticPolicy, state: ElasticState, reading: MemoryReading, now: float, asked_bytes: int = 0
) -> Decision:
    """What the pool does now. ``asked_bytes``: how much more the server asked for (pages times page
    bytes; 0: no ask). Pressure wins over an ask."""
    _bytes("decide", "asked_bytes", asked_bytes)
    if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
        raise ConfigError(f"decide now={now!r}: pass the caller's monotonic clock, in seconds")
    floor = min(state.reserved, max(policy.floor, state.pinned_floor))
    scopes = _scopes(reading)
    psi = None if reading.psi is None else reading.psi.some.avg10
    pressed = (
        [f"PSI some avg10 {psi:.2f} % >= {policy.shrink_psi} %"] if psi is not None and psi >= policy.shrink_psi else []
    )
    pressed += [
        f"{s.name} {s.used / s.limit:.0%} used >= {policy.shrink_used:.0%}"
        for s in scopes
        if s.used >= policy.shrink_used * s.limit
    ]
    if pressed:
        return _shrink(policy, state, floor, now, "; ".join(pressed))
    unsettled = (
        [f"PSI some avg10 {psi:.2f} % >= calm {policy.calm_psi} %"]
        if psi is not None and psi >= policy.calm_psi
        else []
    )
    unsettled += [
        f"{s.name} {s.used / s.limit:.0%} used >= calm {policy.calm_used:.0%}"
        for s in scopes
        if s.used >= policy.calm_used * s.limit
    ]
    if unsettled:
        return Decision(Action.HOLD, 0, f"hold: not calm ({'; '.join(unsettled)})")
    return _grow(policy, state, scopes, now, asked_bytes)


def _shrink(policy: ElasticPolicy, state: ElasticState, floor: int, now: float, why: str) -> Decision:
    if state.pinned <= floor:
        return Decision(
            Action.HOLD, 0, f"hold at the floor ({_gib(floor)}) under pressure: {why}", pressure=True, at_floor=True
        )
    if state.last_shrink_at is not None and now - state.last_shrink_at < policy.shrink_interval_seconds:
        waited = now - state.last_shrink_at
        return Decision(
            Action.HOLD, 0, f"hold: under pressure ({why}), but the last shrink was {waited:.1f} s ago "
            f"(shrink_interval_seconds={policy.shrink_interval_seconds})", pressure=True,
        )  # fmt: skip
    nbytes = min(policy.step, state.pinned - floor)
    if state.pinned - nbytes == floor:
        return Decision(
            Action.SHRINK_TO_FLOOR, nbytes, f"shrink by {_gib(nbytes)} to the floor ({_gib(floor)}) under "
            f"pressure: {why}", pressure=True, at_floor=True,
        )  # fmt: skip
    return Decision(Action.SHRINK, nbytes, f"shrink by {_gib(nbytes)} under pressure: {why}", pressure=True)


def _grow(policy: ElasticPolicy, state: ElasticState, scopes: list[_Scope], now: float, asked: int) -> Decision:
    if state.last_shrink_at is not None and now - state.last_shrink_at < policy.cooldown_seconds:
        since = now - state.last_shrink_at
        return Decision(
            Action.HOLD, 0, f"hold: calm, but the last shrink was {since:.1f} s ago "
            f"(cooldown_seconds={policy.cooldown_seconds})",
        )  # fmt: skip
    if asked:
        want, why = -(-asked // policy.step) * policy.step, f"the server asked for {_gib(asked)}"
    elif policy.grow_while_free:
        want, why = policy.step, "memory is free"
    else:
        return Decision(Action.HOLD, 0, "hold: calm, nothing asked")
    want = min(want, state.reserved - state.pinned)
    if want == 0:
        return Decision(Action.HOLD, 0, f"hold: {why}, but the pool pins its whole reservation")
    if not scopes:
        return Decision(Action.HOLD, 0, f"hold: {why}, but free memory is unknown (no cgroup, no MemAvailable)")
    tightest = min(scopes, key=lambda s: s.free)
    keep = policy.headroom if type(policy.headroom) is int else math.ceil(policy.headroom * tightest.limit)
    room = min(tightest.free - keep, *(math.floor(policy.calm_used * s.limit) - s.used for s in scopes))
    if want > room:
        want = max(0, room) // policy.step * policy.step
        if want == 0:
            return Decision(
                Action.HOLD, 0, f"hold: {why}, but {tightest.name} has {_gib(tightest.free)} free, not a step "
                f"({_gib(policy.step)}) above the headroom ({_gib(keep)}) and the calm line",
            )  # fmt: skip
    return Decision(Action.GROW, want, f"grow by {_gib(want)}: {why}")
