"""The elastic policy (pure): its checks, each decision on hand-made readings, and properties over
random policies, states and reading sequences: never below the floor, never above the reservation, no
grow within the cooldown after a shrink, no flapping around one threshold."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pinpool import ConfigError
from pinpool._plan import Action, Decision, ElasticPolicy, ElasticState, decide
from pinpool._types import MemoryReading, PsiLine, PsiReading

MiB, GiB = 1 << 20, 1 << 30
POLICY = ElasticPolicy(floor=2 * GiB, step=GiB, headroom=0.2, cooldown_seconds=30.0, shrink_interval_seconds=2.0)


def psi(avg10: float) -> PsiReading:
    return PsiReading("/proc/pressure/memory", PsiLine(avg10, avg10, avg10, 0), PsiLine(0.0, 0.0, 0.0, 0))


def reading(
    *, some: float | None = 0.0, usage: int | None = 8 * GiB, limit: int | None = 32 * GiB, high: int | None = None,
    cache: int = 0, available: int | None = 100 * GiB, total: int | None = 128 * GiB,
) -> MemoryReading:  # fmt: skip
    return MemoryReading(
        psi=None if some is None else psi(some), cgroup_version=2, cgroup_path="/pod", usage_bytes=usage,
        limit_bytes=limit, high_bytes=high, reclaimable_bytes=cache, mem_available_bytes=available,
        mem_total_bytes=total,
    )  # fmt: skip


STATE = ElasticState(reserved=16 * GiB, pinned=6 * GiB)


# -- the checks -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("floor", -1, "non-negative whole number of bytes"),
        ("floor", 1.5, "floor=1.5"),
        ("step", 0, "positive whole number"),
        ("step", True, "step=True"),
        ("headroom", 1.0, "below 1.0"),
        ("headroom", -0.1, "headroom=-0.1"),
        ("headroom", -5, "headroom=-5"),
        ("headroom", "20%", "headroom='20%'"),
        ("grow_while_free", 1, "True or False"),
        ("shrink_psi", 0, "above 0, up to 100"),
        ("shrink_psi", 101, "shrink_psi=101"),
        ("shrink_psi", float("nan"), "shrink_psi=nan"),
        ("calm_psi", 10.0, "not below shrink_psi"),
        ("calm_psi", -1, "calm_psi=-1"),
        ("shrink_used", 1.5, "above 0, up to 1"),
        ("calm_used", 0.9, "not below shrink_used"),
        ("cooldown_seconds", -1, "cooldown_seconds=-1"),
        ("cooldown_seconds", float("inf"), "finite"),
        ("shrink_interval_seconds", "2", "shrink_interval_seconds='2'"),
    ],
)
def test_policy_checks_name_the_field_and_fix(field: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match=f"ElasticPolicy {field}=") as caught:
        ElasticPolicy(**{field: value})  # type: ignore[arg-type]
    assert fragment in str(caught.value)


def test_the_defaults_and_a_bytes_headroom_are_valid() -> None:
    assert ElasticPolicy().headroom == 0.2 and ElasticPolicy(headroom=4 * GiB).headroom == 4 * GiB


def test_floor_above_the_reservation() -> None:
    POLICY.check(2 * GiB)
    with pytest.raises(ConfigError, match="floor=2147483648 is above the pool's reservation of 1073741824"):
        POLICY.check(GiB)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"reserved": -1, "pinned": 0}, "ElasticState reserved=-1"),
        ({"reserved": GiB, "pinned": 2 * GiB}, "pinned=2147483648 is above reserved"),
        ({"reserved": GiB, "pinned": 0, "pinned_floor": 0.5}, "pinned_floor=0.5"),
    ],
)
def test_state_checks(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        ElasticState(**kwargs)  # type: ignore[arg-type]


def test_decide_checks_its_inputs() -> None:
    with pytest.raises(ConfigError, match="asked_bytes=-1"):
        decide(POLICY, STATE, reading(), 0.0, -1)
    with pytest.raises(ConfigError, match="now=nan"):
        decide(POLICY, STATE, reading(), float("nan"))


# -- shrinking ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pressure", "why"),
    [
        (reading(some=10.0), "PSI some avg10 10.00 % >= 10.0 %"),
        (reading(usage=29 * GiB), "cgroup memory limit 91% used >= 90%"),
        (reading(usage=10 * GiB, high=11 * GiB), "cgroup memory.high 91% used >= 90%"),
        (reading(limit=None, available=8 * GiB), "host memory 94% used >= 90%"),
    ],
)
def test_each_signal_shrinks_by_a_step(pressure: MemoryReading, why: str) -> None:
    decision = decide(POLICY, STATE, pressure, 100.0, asked_bytes=GiB)  # pressure wins over an ask
    assert decision == Decision(Action.SHRINK, GiB, f"shrink by 1.00 GiB under pressure: {why}", pressure=True)


def test_page_cache_at_the_limit_is_not_pressure() -> None:
    # A cgroup full of page cache reads usage == limit, but the kernel drops cache before any OOM kill.
    decision = decide(POLICY, STATE, reading(usage=32 * GiB, cache=24 * GiB), 100.0)
    assert decision.action is Action.HOLD and not decision.pressure


def test_the_shrink_that_reaches_the_floor_is_its_own_action() -> None:
    state = dataclasses.replace(STATE, pinned=POLICY.floor + GiB // 2)
    decision = decide(POLICY, state, reading(some=50.0), 100.0)
    assert (decision.action, decision.nbytes, decision.at_floor) == (Action.SHRINK_TO_FLOOR, GiB // 2, True)
    assert decision.reason.startswith("shrink by 0.50 GiB to the floor (2.00 GiB) under pressure: PSI")
    at_floor = state.after(decision, 100.0)
    assert at_floor.pinned == POLICY.floor and at_floor.last_shrink_at == 100.0
    held = decide(POLICY, at_floor, reading(some=50.0), 200.0)
    assert (held.action, held.nbytes, held.pressure, held.at_floor) == (Action.HOLD, 0, True, True)
    assert held.reason.startswith("hold at the floor (2.00 GiB) under pressure")


def test_the_servers_pinned_floor_binds_above_the_policys() -> None:
    state = dataclasses.replace(STATE, pinned_floor=5 * GiB + GiB // 4)
    decision = decide(POLICY, state, reading(some=50.0), 100.0)
    assert (decision.action, decision.nbytes) == (Action.SHRINK_TO_FLOOR, 3 * GiB // 4)


def test_successive_shrinks_wait_the_interval() -> None:
    state = dataclasses.replace(STATE, last_shrink_at=99.0)
    held = decide(POLICY, state, reading(some=50.0), 100.0)
    assert (held.action, held.pressure, held.at_floor) == (Action.HOLD, True, False)
    assert "last shrink was 1.0 s ago (shrink_interval_seconds=2.0)" in held.reason
    assert decide(POLICY, state, reading(some=50.0), 101.0).action is Action.SHRINK


# -- holding and growing --------------------------------------------------------------------------------------


def test_the_band_between_calm_and_pressure_holds() -> None:
    for between in (reading(some=5.0), reading(usage=26 * GiB)):
        decision = decide(POLICY, STATE, between, 100.0, asked_bytes=GiB)
        assert decision.action is Action.HOLD and decision.reason.startswith("hold: not calm (")


def test_no_grow_within_the_cooldown_after_a_shrink() -> None:
    state = dataclasses.replace(STATE, last_shrink_at=100.0)
    held = decide(POLICY, state, reading(), 129.9, asked_bytes=GiB)
    assert held.action is Action.HOLD and "cooldown_seconds=30.0" in held.reason
    assert decide(POLICY, state, reading(), 130.0, asked_bytes=GiB).action is Action.GROW


def test_an_ask_grows_in_whole_steps() -> None:
    decision = decide(POLICY, STATE, reading(), 100.0, asked_bytes=GiB + 1)
    assert decision == Decision(Action.GROW, 2 * GiB, "grow by 2.00 GiB: the server asked for 1.00 GiB")
    assert STATE.after(decision, 100.0) == dataclasses.replace(STATE, pinned=8 * GiB, last_grow_at=100.0)


def test_growth_stops_at_the_reservation() -> None:
    assert decide(POLICY, STATE, reading(), 0.0, asked_bytes=64 * GiB).nbytes == 10 * GiB
    full = dataclasses.replace(STATE, pinned=STATE.reserved)
    assert "whole reservation" in decide(POLICY, full, reading(), 0.0, asked_bytes=GiB).reason


def test_growth_keeps_the_headroom_free() -> None:
    # 32 GiB limit, 20 % headroom: 6.4 GiB kept, 22 GiB used leaves 3.6 GiB: 3 whole steps.
    # (calm_used 75 % of 32 GiB = 24 GiB: 2 GiB of room under the calm line binds first.)
    assert decide(POLICY, STATE, reading(usage=22 * GiB), 0.0, asked_bytes=8 * GiB).nbytes == 2 * GiB
    roomy = dataclasses.replace(POLICY, calm_used=0.85)
    assert decide(roomy, STATE, reading(usage=22 * GiB), 0.0, asked_bytes=8 * GiB).nbytes == 3 * GiB
    in_bytes = dataclasses.replace(roomy, headroom=9 * GiB + GiB // 2)
    assert decide(in_bytes, STATE, reading(usage=22 * GiB), 0.0, asked_bytes=8 * GiB).nbytes == 0
    held = decide(in_bytes, STATE, reading(usage=22 * GiB), 0.0, asked_bytes=8 * GiB)
    assert held.action is Action.HOLD and "not a step (1.00 GiB) above the headroom (9.50 GiB)" in held.reason


def test_no_ask_grows_only_when_opted_in() -> None:
    assert decide(POLICY, STATE, reading(), 0.0) == Decision(Action.HOLD, 0, "hold: calm, nothing asked")
    opted = dataclasses.replace(POLICY, grow_while_free=True)
    assert decide(opted, STATE, reading(), 0.0) == Decision(Action.GROW, GiB, "grow by 1.00 GiB: memory is free")


def test_unknown_free_memory_grows_nothing() -> None:
    blind = MemoryReading(psi=psi(0.0))
    held = decide(POLICY, STATE, blind, 0.0, asked_bytes=GiB)
    assert held.action is Action.HOLD and "free memory is unknown" in held.reason


def test_a_partial_shrink_is_recorded_as_done() -> None:
    decision = decide(POLICY, STATE, reading(some=50.0), 5.0)
    assert STATE.after(decision, 5.0, done=GiB // 2).pinned == 6 * GiB - GiB // 2
    assert STATE.after(Decision(Action.HOLD, 0, "hold"), 5.0) is STATE


# -- properties -----------------------------------------------------------------------------------------------

policies = st.builds(
    ElasticPolicy,
    floor=st.integers(0, 8).map(lambda n: n * GiB // 2),
    step=st.sampled_from([MiB, 256 * MiB, GiB, 3 * GiB]),
    headroom=st.one_of(st.floats(0.0, 0.5), st.integers(0, 8 * GiB)),
    grow_while_free=st.booleans(),
    shrink_psi=st.floats(5.0, 50.0),
    calm_psi=st.floats(0.0, 4.9),
    shrink_used=st.floats(0.8, 1.0),
    calm_used=st.floats(0.3, 0.79),
    cooldown_seconds=st.floats(0.0, 60.0),
    shrink_interval_seconds=st.floats(0.0, 5.0),
)
readings = st.builds(
    reading,
    some=st.one_of(st.none(), st.floats(0.0, 100.0)),
    usage=st.one_of(st.none(), st.integers(0, 40 * GiB)),
    limit=st.one_of(st.none(), st.integers(1, 40 * GiB)),
    high=st.one_of(st.none(), st.integers(1, 40 * GiB)),
    cache=st.integers(0, 4 * GiB),
    available=st.one_of(st.none(), st.integers(0, 64 * GiB)),
    total=st.one_of(st.none(), st.just(64 * GiB)),
)
steps = st.lists(
    st.tuples(readings, st.floats(0.0, 20.0), st.integers(0, 4 * GiB), st.floats(0.0, 1.0)), min_size=1, max_size=40
)


@settings(max_examples=100, deadline=None)
@given(policies, st.integers(0, 24), st.integers(0, 24), st.integers(0, 16), steps)
def test_never_below_the_floor_never_above_the_reservation_no_grow_in_cooldown(
    policy: ElasticPolicy, reserved_halves: int, pinned_halves: int, pinned_floor_halves: int, sequence: list
) -> None:
    reserved = max(reserved_halves, pinned_halves) * GiB // 2
    state = ElasticState(reserved, pinned_halves * GiB // 2, pinned_floor_halves * GiB // 2)
    now = 0.0
    for observed, elapsed, asked, share in sequence:
        now += elapsed
        decision = decide(policy, state, observed, now, asked)
        floor = min(reserved, max(policy.floor, state.pinned_floor))
        assert decision.reason
        assert (decision.nbytes == 0) == (decision.action is Action.HOLD)
        if decision.action is Action.GROW:
            assert state.pinned + decision.nbytes <= reserved
            assert not decision.pressure
            assert state.last_shrink_at is None or now - state.last_shrink_at >= policy.cooldown_seconds
            assert asked or policy.grow_while_free
        elif decision.action is not Action.HOLD:
            assert decision.pressure and state.pinned - decision.nbytes >= floor
            assert decision.nbytes <= policy.step
            assert (decision.action is Action.SHRINK_TO_FLOOR) == (state.pinned - decision.nbytes == floor)
        elif decision.at_floor:
            assert decision.pressure and state.pinned <= floor
        done = decision.nbytes if decision.action is Action.GROW else int(decision.nbytes * share)
        state = state.after(decision, now, done)
        assert 0 <= state.pinned <= reserved


@settings(max_examples=100, deadline=None)
@given(
    policies,
    st.sampled_from(["psi_shrink", "psi_calm", "used_shrink", "used_calm"]),
    st.lists(st.tuples(st.booleans(), st.floats(0.0, 0.49), st.floats(0.1, 3.0)), min_size=2, max_size=40),
)
def test_readings_wandering_around_one_threshold_do_not_flap(policy: ElasticPolicy, which: str, wobble: list) -> None:
    """Around the shrink line the pool shrinks and never grows back; around the calm line it may grow
    but never shrinks. Either way it moves in one direction only."""
    state = ElasticState(reserved=64 * GiB, pinned=32 * GiB)
    limit, now, actions = 100 * GiB, 0.0, []
    for above, share, elapsed in wobble:
        now += elapsed
        # A wobble of up to half the band either side of the line: it crosses that one line only.
        if which.startswith("psi"):
            line = policy.shrink_psi if which == "psi_shrink" else policy.calm_psi
            offset = share * (policy.shrink_psi - policy.calm_psi)
            some = max(0.0, line + offset if above else line - offset - 1e-6)
            observed = reading(some=some, usage=0, limit=limit, available=None)
        else:
            line = policy.shrink_used if which == "used_shrink" else policy.calm_used
            offset = share * (policy.shrink_used - policy.calm_used)
            used = min(1.0, max(0.0, line + offset if above else line - offset - 1e-6))
            observed = reading(some=0.0, usage=int(limit * used), limit=limit, available=None)
        decision = decide(policy, state, observed, now, asked_bytes=GiB)
        actions.append(decision.action)
        state = state.after(decision, now)
    moved = {a for a in actions if a is not Action.HOLD}
    assert not ({Action.GROW} & moved and {Action.SHRINK, Action.SHRINK_TO_FLOOR} & moved), actions
    if which.endswith("calm"):
        assert not {Action.SHRINK, Action.SHRINK_TO_FLOOR} & moved


@settings(max_examples=100, deadline=None)
@given(policies, st.lists(st.tuples(readings, st.floats(0.0, 20.0)), min_size=2, max_size=60))
def test_direction_changes_are_bounded_by_the_cooldown(policy: ElasticPolicy, sequence: list) -> None:
    """Any sequence at all: each shrink-then-grow turn costs a cooldown, so the turns in T seconds are at
    most T / cooldown_seconds + 1."""
    state = ElasticState(reserved=64 * GiB, pinned=32 * GiB)
    now, last, turns = 0.0, None, 0
    for observed, elapsed in sequence:
        now += elapsed
        decision = decide(policy, state, observed, now, asked_bytes=GiB)
        if decision.action is not Action.HOLD:
            direction = "grow" if decision.action is Action.GROW else "shrink"
            turns += last == "shrink" and direction == "grow"
            last = direction
        state = state.after(decision, now)
    if policy.cooldown_seconds > 0:
        assert turns <= now / policy.cooldown_seconds + 1
