"""A runtime is untrusted (issue 23, item 5 / finding 6).

A runtime call that raises anything but :class:`pinpool.RuntimeCallError` (its typed "nothing was
done"), or returns something other than None, may have done its work before it went wrong. A
register call like that used to be booked as failed, so a range it had registered stayed pinned
after ``close()`` with ``leaked=[]`` (64 MiB under mlock). Now it is booked as "may be registered"
and undone at teardown (a "not registered" answer there is fine), or reported as leaked; a
``SystemExit`` or ``KeyboardInterrupt`` from the runtime is raised as itself once teardown is done.

Every runtime call the engine makes (register, lock-on-fault, populate, unregister) x every kind of
misbehaviour x before or after the call did its work x sync, asyncio and trio x foreground and
background: after the pool is left, the runtime's books are empty (or the range is reported
leaked), no range claim is held, and a new pool in the same process works.
"""

from __future__ import annotations

import dataclasses
import gc
import pickle
from collections.abc import Iterator

import pytest
import structlog

import pinpool
from pinpool._pin import untrusted_call
from pinpool._ranges import PINNED_RANGES
from pinpool.runtimes import MlockRuntime
from pinpool.testing import FakeRuntime, locked_bytes

from ..conftest import each_driver, lifecycle_of, needs_mlock

MiB = 1 << 20
pytestmark = pytest.mark.anyio

CALLS = ("register", "lock_on_fault", "populate", "unregister")


class Undecodable(Exception):
    """A driver message that fails to decode: reading it raises (issue 33, item 6)."""

    def __str__(self) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


class Interrupt(KeyboardInterrupt):
    pass


class UndecodableInterrupt(KeyboardInterrupt):
    def __str__(self) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


# What the runtime does instead of returning None: raise one of these, or return garbage.
KINDS: dict[str, type[BaseException] | None] = {
    "Exception": Exception,
    "RuntimeError": RuntimeError,
    "SystemExit": SystemExit,
    "KeyboardInterrupt": KeyboardInterrupt,
    "Undecodable": Undecodable,
    "UndecodableInterrupt": UndecodableInterrupt,
    "garbage": None,
}
ON_CALL = 2  # the misbehaving call: the second of its kind, so one before it went well


class Misbehaves(FakeRuntime):
    """A FakeRuntime whose ``ON_CALL``-th call of ``call`` misbehaves as ``kind`` says, ``when``
    "before" it did anything or "after" it did its work (registered, faulted, unregistered)."""

    def __init__(self, call: str, kind: str, when: str) -> None:
        super().__init__(lock_on_fault=call == "lock_on_fault")
        self.call, self.kind, self.when = call, kind, when
        self.seen = 0
        self.fired = False

    def _misbehaves(self, op: str) -> bool:
        if op != ("register" if self.call == "lock_on_fault" else self.call):
            return False
        self.seen += 1
        return self.seen == ON_CALL

    def _answer(self) -> object:
        self.fired = True
        kind = KINDS[self.kind]
        if kind is None:
            return {"status": "ok?"}  # garbage: a runtime's calls return None
        raise kind(f"{self.kind} from the runtime's {self.call}, {self.when} its work")

    def register(self, ptr: int, nbytes: int) -> None:  # lock_on_fault calls it too
        if not self._misbehaves("register"):
            return super().register(ptr, nbytes)
        if self.when == "after":
            super().register(ptr, nbytes)
        return self._answer()  # type: ignore[return-value]

    def lock_on_fault(self, ptr: int, nbytes: int) -> None:
        return self.register(ptr, nbytes)  # FakeRuntime's drops what register returns; garbage must show

    def populate(self, ptr: int, nbytes: int) -> None:
        if not self._misbehaves("populate"):
            return super().populate(ptr, nbytes)
        if self.when == "after":
            super().populate(ptr, nbytes)
        return self._answer()  # type: ignore[return-value]

    def unregister(self, ptr: int) -> None:
        if not self._misbehaves("unregister"):
            return super().unregister(ptr)
        if self.when == "after":
            super().unregister(ptr)
        return self._answer()  # type: ignore[return-value]


@pytest.fixture
def claims() -> Iterator[dict[int, int]]:
    before = PINNED_RANGES.snapshot()
    yield before
    for base in PINNED_RANGES.snapshot().keys() - before.keys():  # a test's reported leak, released by hand
        PINNED_RANGES.pop(base)


async def leave(pool: pinpool.PinnedPool, mode: str, background: bool) -> list[BaseException]:
    """Enter and leave ``pool``; a background body waits for pinning to end first (so the call
    that misbehaves is made). Returns every error seen: the waiter's, then the one leaving raised."""
    seen: list[BaseException] = []
    try:
        if mode == "async":
            async with pool:
                if background:
                    try:
                        await pool.wait_ready()
                    except pinpool.PinError as exc:
                        seen.append(exc)
        else:
            with pool:
                if background:
                    try:
                        pool.wait_ready_sync()
                    except pinpool.PinError as exc:
                        seen.append(exc)
    except BaseException as exc:  # KeyboardInterrupt and SystemExit included: they are what is checked
        seen.append(exc)
    return seen


def failures_of(seen: list[BaseException]) -> list[pinpool.RuntimeCallError]:
    """Every failed call the errors report (PinError / UnpinError), whoever raised them."""
    errors = [exc for exc in seen if isinstance(exc, pinpool.PinError | pinpool.UnpinError)]
    return [failure.error for exc in errors for failure in exc.failures]


@each_driver
@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("call", CALLS)
async def test_a_misbehaving_runtime_call_is_never_forgotten(
    mode: str, background: bool, when: str, kind: str, call: str, claims: dict[int, int]
) -> None:
    fake = Misbehaves(call, kind, when)
    pool = pinpool.PinnedPool(
        size=8 * MiB, chunk_bytes=MiB, runtime=fake, registry=None, background=background, unpin_workers=1,
        register_workers=1, populate_workers=1,
    )  # fmt: skip
    seen = await leave(pool, mode, background)
    assert fake.fired, "the misbehaving call was never made"
    base = KINDS[kind]
    if base is not None and not issubclass(base, Exception):
        # Raised as itself, once teardown is done, and only once; the typed error is in its notes.
        # Raised as itself, once teardown is done, and only once.
        assert len([exc for exc in seen if isinstance(exc, base)]) == 1, seen
    else:
        assert not [exc for exc in seen if not isinstance(exc, pinpool.PinpoolError)], seen
    # The typed failure is reported: by a PinError / UnpinError, or in the notes of the
    # SystemExit / KeyboardInterrupt raised in its place.
    reason = "UnexpectedReturn" if base is None else kind
    reported = [f"({error.reason})" for error in failures_of(seen)]
    reported += [note for exc in seen for note in getattr(exc, "__notes__", ())]
    assert any(f"({reason})" in text for text in reported), f"the misbehaving call was not reported: {seen}"

    leaked = {chunk.offset for chunk in lifecycle_of(pool).session.ledger.leaked()}  # type: ignore[union-attr]
    if call == "unregister":
        # It may still be registered (whatever the runtime did): reported as leaked, its claim kept.
        assert len(leaked) == 1
        assert len(fake.registered) == (1 if when == "before" else 0)
        assert len(PINNED_RANGES.snapshot().keys() - claims.keys()) == 1
    else:
        # Registered then raised (or returned garbage): unregistered at teardown; raised before
        # registering: the runtime's "not registered" answer is fine. Nothing leaked either way.
        assert fake.registered == {}, fake.registered
        assert leaked == set()
        assert PINNED_RANGES.snapshot() == claims
    assert len(pool.registrations) == len(leaked)  # a leaked range stays listed: it may be registered

    # The process is fine: a new pool (same runtime object, misbehaviour spent) pins and unpins.
    with pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake, registry=None) as again:
        assert again.pinned_bytes == 4 * MiB
    assert len(fake.registered) == (1 if call == "unregister" and when == "before" else 0)


def test_a_register_call_that_registered_and_raised_is_never_retried() -> None:
    """A maybe-registered range is not halved and tried again (that would register it twice), even
    from a runtime that declares its code retryable (-1: the code of any foreign exception)."""
    fake = Misbehaves("register", "RuntimeError", "after")
    fake.capabilities = dataclasses.replace(fake.capabilities, retryable_codes=frozenset({-1, 2}))
    pool = pinpool.PinnedPool(size=8 * MiB, chunk_bytes=4 * MiB, runtime=fake, registry=None, populate=False)
    with pytest.raises(pinpool.PinError) as info:
        pool.__enter__()
    assert info.value.reason == "RuntimeError" and info.value.leaked == ()
    assert len(fake.register_calls) == 2  # the first chunk, and the one that raised: no halves
    assert fake.registered == {}
    assert fake.unregister_calls.count(fake.register_calls[1][0]) == 1  # the maybe-registered range, undone


def test_a_maybe_registered_range_the_runtime_never_registered_is_logged_not_registered() -> None:
    """Raised before registering: teardown's unregister answers "not registered" (713), which is
    fine for such a range: an info event chunk.not_registered, not a leak, not released_elsewhere."""
    fake = Misbehaves("register", "RuntimeError", "before")
    with structlog.testing.capture_logs() as logs:  # the pool binds its logger when constructed
        pool = pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake, registry=None, populate=False)
        with pytest.raises(pinpool.PinError) as info:
            pool.__enter__()
    assert info.value.leaked == ()
    (absent,) = [e for e in logs if e["event"] == "chunk.not_registered"]
    assert absent["log_level"] == "info" and absent["code"] == 713 and absent["offset"] == MiB
    assert int(absent["ptr"], 16) == fake.register_calls[0][0] + MiB  # the second chunk, never registered
    assert not [e for e in logs if e["event"] in ("chunk.released_elsewhere", "pool.unpin.failed")]
    assert fake.registered == {}


def test_a_maybe_registered_range_that_fails_to_unregister_is_reported_leaked(claims: dict[int, int]) -> None:
    """Registered, then raised; and its unregister fails too: reported as leaked, never forgotten."""
    fake = Misbehaves("register", "RuntimeError", "after")
    fake.fail_unregister_on = frozenset({1})  # the rollback undoes the maybe-registered range first
    pool = pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake, registry=None, populate=False)
    with pytest.raises(pinpool.PinError) as info:
        pool.__enter__()
    assert [chunk.nbytes for chunk in info.value.leaked] == [MiB]
    assert list(fake.registered.values()) == [MiB]  # still registered, as the leak says


@pytest.mark.parametrize("call", ["register", "lock_on_fault"])
def test_a_background_failure_says_which_registrations_may_be_registered(call: str) -> None:
    """A background pool keeps what it pinned after a failure; its text counts a maybe-registered
    range as such, not as "locked on fault but not faulted in" nor as pinned."""
    fake = Misbehaves(call, "RuntimeError", "after")
    pool = pinpool.PinnedPool(
        size=8 * MiB, chunk_bytes=MiB, runtime=fake, registry=None, background=True, register_workers=1,
        populate_workers=1,
    )  # fmt: skip
    with pool:
        with pytest.raises(pinpool.PinError) as info:
            pool.wait_ready_sync()
        text = str(info.value)
        assert len(pool.registrations) == 2, pool.registrations
        assert "1 MiB of them a register call that failed but may have registered)" in text, text
        if call == "register":  # under lock-on-fault the first chunk may not be faulted in yet
            assert pool.pinned_bytes == MiB and "1 MiB pinned, 2 registration(s) of 2 MiB (1 MiB of them a" in text
            assert "locked on fault" not in text, text
    assert fake.registered == {}


def test_untrusted_call_classifies_every_answer() -> None:
    def returns(value: object) -> object:
        return lambda ptr, nbytes: value

    def raises(exc: BaseException) -> object:
        def call(ptr: int, nbytes: int) -> None:
            raise exc

        return call

    assert untrusted_call(returns(None), "register", 4096, 8).error is None
    typed = pinpool.RuntimeCallError(op="register", code=2, reason="X", message="m", ptr=4096, nbytes=8)
    answer = untrusted_call(raises(typed), "register", 4096, 8)  # type: ignore[arg-type]
    assert answer.error is typed and not answer.maybe and answer.raised is None
    answer = untrusted_call(raises(ValueError("v")), "register", 4096, 8)  # type: ignore[arg-type]
    assert answer.maybe and answer.raised is None and answer.error is not None and answer.error.reason == "ValueError"
    stop = SystemExit(3)
    answer = untrusted_call(raises(stop), "register", 4096, 8)  # type: ignore[arg-type]
    assert answer.maybe and answer.raised is stop and answer.error is not None
    answer = untrusted_call(returns("x" * 10_000), "register", 4096, 8)  # type: ignore[arg-type]
    assert answer.maybe and isinstance(answer.error, pinpool.UnexpectedReturn)
    assert len(answer.error.message) < 400  # bounded, whatever came back
    again = pickle.loads(pickle.dumps(answer.error))
    assert type(again) is pinpool.UnexpectedReturn and again.returned == answer.error.returned

    class BadRepr:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    answer = untrusted_call(returns(BadRepr()), "unregister", 4096, 0)  # type: ignore[arg-type]
    assert isinstance(answer.error, pinpool.UnexpectedReturn) and "BadRepr" in answer.error.message


# -- real mlock -------------------------------------------------------------------------------------


class MlocksThenRaises(MlockRuntime):
    """Locks its second range for real (mlock2 on fault), then raises: the finding's runtime."""

    def __init__(self, kind: type[BaseException]) -> None:
        super().__init__()
        self.kind = kind
        self.calls = 0

    def lock_on_fault(self, ptr: int, nbytes: int) -> None:
        super().lock_on_fault(ptr, nbytes)
        self.calls += 1
        if self.calls == 2:
            raise self.kind("locked, then raised")


@pytest.mark.parametrize("kind", [RuntimeError, SystemExit, KeyboardInterrupt])
def test_mlock_a_range_locked_then_raised_is_unlocked_at_close(kind: type[BaseException]) -> None:
    """The finding: 64 MiB stayed locked (VmLck) after close(), with leaked=[]."""
    baseline = locked_bytes()
    runtime = MlocksThenRaises(kind)
    pool = pinpool.PinnedPool(size=128 * MiB, chunk_bytes=64 * MiB, runtime=runtime, registry=None)
    with pytest.raises(pinpool.PinError if issubclass(kind, Exception) else kind) as info:
        pool.__enter__()
    if issubclass(kind, Exception):
        assert info.value.leaked == ()  # type: ignore[attr-defined]
    assert runtime.registered == {}
    assert locked_bytes() == baseline
    with pinpool.PinnedPool(size=8 * MiB, runtime=MlockRuntime(), registry=None) as again:
        assert locked_bytes() - baseline == 8 * MiB
        assert again.pinned_bytes == 8 * MiB
    assert locked_bytes() == baseline


class RaisesOnceAfterUnlocking(MlockRuntime):
    """Real munlock; its first unregister raises ``exc`` once the range is unlocked."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc: BaseException | None = exc

    def unregister(self, ptr: int) -> None:
        super().unregister(ptr)
        exc, self.exc = self.exc, None
        if exc is not None:
            raise exc


@needs_mlock
@each_driver
@pytest.mark.parametrize("exc", [Undecodable(), Interrupt(), UndecodableInterrupt()], ids=type)
async def test_mlock_a_hostile_exception_in_unregister_fails_that_chunk_only(
    mode: str, exc: BaseException, vmlck_baseline: int
) -> None:
    """Issue 33, item 6: an exception whose __str__ raised ended the unpin worker (6 x 32 MiB never
    unregistered, VmLck 192 MiB after close() and gc); a KeyboardInterrupt subclass likewise."""
    runtime = RaisesOnceAfterUnlocking(exc)
    pool = pinpool.PinnedPool(size=64 * MiB, chunk_bytes=8 * MiB, runtime=runtime, registry=None, unpin_workers=1)
    seen = await leave(pool, mode, background=False)
    assert runtime.registered == {}  # every other chunk was unregistered
    if isinstance(exc, Exception):
        (error,) = failures_of(seen)  # that chunk alone failed, its text unreadable but typed
        assert error.reason == "Undecodable" and error.message == "<Undecodable whose str raised UnicodeDecodeError>"
    else:
        assert seen == [exc]  # raised as itself once teardown is done
    del pool, seen
    gc.collect()
    assert locked_bytes() == vmlck_baseline


BIG = "x" * (64 << 20)


class Verbose(FakeRuntime):
    """Every call of ``op`` does its work, then raises an exception with a 64 MiB message."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op

    def register(self, ptr: int, nbytes: int) -> None:
        super().register(ptr, nbytes)
        if self.op == "register":
            raise RuntimeError(BIG)

    def unregister(self, ptr: int) -> None:
        super().unregister(ptr)
        if self.op == "unregister":
            raise RuntimeError(BIG)


@pytest.mark.parametrize("op", ["register", "unregister"])
def test_a_huge_exception_message_is_bounded_in_every_failure(op: str, claims: dict[int, int]) -> None:
    """Issue 33, item 6: the runtime's 64 MiB message was copied into every chunk's failure."""
    fake = Verbose(op)
    pool = pinpool.PinnedPool(size=8 * MiB, chunk_bytes=MiB, runtime=fake, registry=None, unpin_workers=1)
    with pytest.raises(pinpool.PinError if op == "register" else pinpool.UnpinError) as info:
        with pool:
            pass
    failures = info.value.failures
    assert len(failures) == (1 if op == "register" else 8)
    for failure in failures:
        assert failure.error.reason == "RuntimeError" and failure.error.message.startswith("xxx")
        assert len(failure.error.message) < 500 and len(str(failure.error)) < 1000
        assert f"({64 << 20} characters)" in failure.error.message
    assert len(str(info.value)) < 2000
