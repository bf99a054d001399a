"""The exception hierarchy: one base, the builtin each failure's callers already catch, pickling."""

from __future__ import annotations

import pickle

import pytest

import pinpool
from pinpool._errors import TEXT_LIMIT, as_runtime_error, class_name, foreign_text
from pinpool.testing import FakeRuntime

MiB = 1 << 20


def failing_pool(*, fail_register_on: int | None = None, fail_unregister_on: int | None = None) -> pinpool.PinnedPool:
    fake = FakeRuntime(fail_register_on=fail_register_on, fail_unregister_on=fail_unregister_on)
    return pinpool.PinnedPool(
        size=4 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=1, populate=False, max_retries=0
    )


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (pinpool.ConfigError, ValueError),
        (pinpool.PoolStateError, RuntimeError),
        (pinpool.RuntimeCallError, RuntimeError),
        (pinpool.PinError, RuntimeError),
        (pinpool.UnpinError, RuntimeError),
        (pinpool.AlreadyPinnedError, RuntimeError),
        (pinpool.AllocationError, MemoryError),
    ],
)
def test_every_error_is_a_pinpool_error_and_the_builtin_callers_catch(
    error: type[Exception], builtin: type[Exception]
) -> None:
    assert issubclass(error, pinpool.PinpoolError) and issubclass(error, builtin)
    assert error.__module__ == "pinpool"


def test_except_runtime_error_catches_a_real_pin_error() -> None:
    """Code written against the reference (SGLang raises RuntimeError when a registration fails)."""
    with pytest.raises(RuntimeError) as caught:
        with failing_pool(fail_register_on=2):
            pytest.fail("the body must not run")
    error = caught.value
    assert isinstance(error, pinpool.PinError)
    assert error.offset == MiB and error.code == 2 and error.phase == "register" and error.leaked == ()
    assert isinstance(error.__cause__, pinpool.RuntimeCallError) and isinstance(error.__cause__, RuntimeError)


def test_pin_error_pickles_with_its_attributes() -> None:
    with pytest.raises(pinpool.PinError) as caught:
        with failing_pool(fail_register_on=2):
            pass
    error = caught.value
    error.add_note("a note")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is pinpool.PinError and isinstance(copy, RuntimeError)
    assert str(copy) == str(error) and copy.args == error.args and copy.__notes__ == ["a note"]
    assert (copy.offset, copy.nbytes, copy.code, copy.reason, copy.phase, copy.leaked) == (
        error.offset, error.nbytes, error.code, error.reason, error.phase, error.leaked,
    )  # fmt: skip
    assert [(f.chunk, f.phase, str(f.error), f.error.code) for f in copy.failures] == [
        (f.chunk, f.phase, str(f.error), f.error.code) for f in error.failures
    ]


def test_unpin_error_is_a_runtime_error_and_pickles() -> None:
    pool = failing_pool(fail_unregister_on=1)
    with pytest.raises(RuntimeError) as caught:
        with pool:
            pass
    error = caught.value
    assert isinstance(error, pinpool.UnpinError) and len(error.failures) == 1
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is pinpool.UnpinError and str(copy) == str(error)
    assert copy.leaked == error.leaked and [f.chunk for f in copy.failures] == [f.chunk for f in error.failures]


def test_runtime_call_error_pickles() -> None:
    error = pinpool.RuntimeCallError(op="mlock", code=12, reason="ENOMEM", message="no", ptr=0x1000, nbytes=4096)
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, pinpool.RuntimeCallError) and isinstance(copy, RuntimeError) and str(copy) == str(error)
    fields = (copy.op, copy.code, copy.reason, copy.message, copy.ptr, copy.nbytes)
    assert fields == ("mlock", 12, "ENOMEM", "no", 0x1000, 4096)


def test_already_pinned_error_is_a_runtime_error() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(2 * MiB, dtype=torch.uint8)
    with pinpool.pin(tensor, runtime=FakeRuntime()):
        with pytest.raises(RuntimeError) as caught:
            with pinpool.pin(tensor, runtime=FakeRuntime()):
                pass
    assert isinstance(caught.value, pinpool.AlreadyPinnedError)
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)


def test_foreign_text_never_raises_and_is_bounded() -> None:
    """Issue 33, item 6: the one way pinpool reads a foreign object's text (a runtime's exception)."""

    class Undecodable(Exception):
        def __str__(self) -> str:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    class NamedBadly(type):
        @property
        def __name__(cls) -> str:  # type: ignore[override]
            raise RuntimeError("no name")

    class Odd(Exception, metaclass=NamedBadly):
        pass

    class Sly(str):
        def __len__(self) -> int:
            raise RuntimeError("no length")

    class SlyText(Exception):
        def __str__(self) -> str:
            return Sly("sly")

    assert foreign_text(Undecodable()) == "<Undecodable whose str raised UnicodeDecodeError>"
    assert class_name(Odd()) == "Odd" and foreign_text(Odd("odd")) == "odd"
    assert foreign_text(SlyText()) == "sly" and type(foreign_text(SlyText())) is str
    long = foreign_text(ValueError("y" * 10_000))
    assert long == "y" * TEXT_LIMIT + "... (10000 characters)"
    assert foreign_text([1, 2], repr, limit=3) == "[1,... (6 characters)"
    error = as_runtime_error(Undecodable(), "unregister", 4096, 0)
    assert error.reason == "Undecodable" and error.message == "<Undecodable whose str raised UnicodeDecodeError>"
    assert isinstance(error.__cause__, Undecodable)
